"""A YDB database for the DLQ store's statements: SQLite underneath, the server's rules on top.

No YDB server runs where these tests run, so ``FakeYdb`` stands in for one
behind the two calls the store makes of the SDK's ``QuerySessionPool``
(``execute_with_retries`` and ``retry_tx_async``, the latter through the
SDK's own retry loop). It reads the YQL the store sends, translates the
subset the store uses to SQLite, and refuses what a YDB server refuses:

* every ``$name`` used must be declared (``DECLARE $name AS Type``) with the
  type of the value sent, and the value must convert to that type (the
  SDK's own protobuf conversion);
* ``UPSERT``/``REPLACE``/``INSERT`` from ``AS_TABLE`` must carry every NOT
  NULL column of the table, as the server's ``CREATE TABLE`` declared it
  ("Missing not null column in input"), and each member's type must be the
  column's (a NOT NULL column takes no optional);
* ``UPDATE ... ON`` and ``DELETE ... ON`` must carry the primary key;
  ``UPDATE ... SET`` may not change a key column;
* ``UPSERT INTO t (columns) SELECT ...`` must name every NOT NULL column
  and put no NULL in one;
* ``VIEW`` must name an index the table was created with;
* a cell holds at most 16 MiB: a bigger value is BAD_REQUEST ("Row cell
  size of N bytes is larger than the allowed threshold"; ydb-platform/ydb
  ``ydb/core/tx/datashard``, ``NLimits::MaxWriteValueSize`` and its checks
  in the datashard's write path), and a statement whose parameters pass
  the SDK's 64 MB gRPC message is BAD_REQUEST too (the SDK's
  ``ydb/connection.py``: ``_DEFAULT_MAX_GRPC_MESSAGE_SIZE``, "Sent message
  larger than max" -> ``issues.BadRequest``);
* a statement answers one result set per ``SELECT``, in order, and
  streams each as several parts that share its ``result_set_index``
  (``part_rows`` rows a part; an empty result set is one empty part): the
  server sends each ``TEvStreamData`` of the executer as one
  ``ExecuteQueryResponsePart`` (ydb-platform/ydb
  ``ydb/core/grpc_services/query/rpc_execute_query.cpp``,
  ``TExecuteQueryRPC::Handle(TEvStreamData)``), so a caller must join the
  parts (the SDK's ``aggregate_result_sets_by_index_async``), as
  ``execute_with_retries`` does inside the SDK.

``immediate_effects=False`` plays a server whose transactions cannot read
their own writes (before YDB 24.1, or with the table service's
``enable_kqp_immediate_effects`` off): a transaction that reads a table it
modified, or modifies a table with secondary indexes a second time, is
refused with the server's words (ydb-platform/ydb
``ydb/core/kqp/provider/yql_kikimr_provider.h``,
``TKikimrTransactionContextBase::ApplyTableOperations``).

``undetermined_commits`` makes the next commits of writing transactions
happen and still answer ``Undetermined``, as a server does when the
outcome of a commit could not be confirmed; the SDK then retries the
transaction only if the store said it is idempotent.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import ydb
from ydb import convert, issues
from ydb.retries import retry_operation_async

# Retries of undetermined commits without the SDK's second-long pauses.
FAST_RETRY = ydb.RetrySettings(
    idempotent=True, slow_backoff_settings=ydb.BackoffSettings(slot_duration=0.001)
)
MAX_CELL_BYTES = 16 * 1024 * 1024  # NLimits::MaxWriteValueSize
MAX_MESSAGE_BYTES = 64 * 10**6  # the SDK's gRPC max_send_message_length
to_protobuf = cast(Callable[[object], object], convert.query_parameters_to_pb)  # untyped
_retry = cast(Callable[..., Awaitable[Any]], retry_operation_async)
_join = cast(
    Callable[[list["ResultSet"]], list["ResultSet"]], convert.aggregate_result_sets_by_index
)


@dataclass
class Table:
    """A table as its ``CREATE TABLE`` declared it."""

    path: str
    columns: dict[str, str]  # name -> type, without NOT NULL
    not_null: set[str]
    primary_key: list[str]
    indexes: set[str]


@dataclass
class ResultSet:
    """What the SDK's result-set aggregation reads of a result set."""

    index: int
    rows: list[dict[str, Any]]
    data: None = None

    def _extend(self, other: ResultSet) -> None:
        self.rows.extend(other.rows)

    def parts(self, size: int) -> list[ResultSet]:
        """This result set as the server streams it: parts of ``size`` rows, one index."""
        chunks = [self.rows[i : i + size] for i in range(0, len(self.rows), size)] or [[]]
        return [ResultSet(self.index, chunk) for chunk in chunks]


class _CountIf:
    def __init__(self) -> None:
        self.n = 0

    def step(self, value: object) -> None:
        self.n += 1 if value else 0

    def finalize(self) -> int:
        return self.n


def _as_bytes(value: object) -> bytes | None:
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(cast(bytes, value))


def _contains(haystack: object, needle: object) -> int | None:
    hay, pin = _as_bytes(haystack), _as_bytes(needle)
    return None if hay is None or pin is None else int(pin in hay)


SqlValue = str | bytes | int | float | None


def _ascii_lower(value: SqlValue) -> SqlValue:
    if isinstance(value, str):
        return value.translate(
            str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
        )
    if isinstance(value, bytes):
        return bytes(b + 32 if 65 <= b <= 90 else b for b in value)
    return value


def _substring(value: SqlValue, start: int, length: int) -> SqlValue:
    # YDB's Substring of an empty String is an empty String, never NULL.
    if value is None:
        return None
    return cast(bytes, value)[start : start + length]


def _literal(text: str) -> SqlValue:
    """A literal of a VALUES list: 'text', or a number."""
    if text.startswith("'"):
        return text.strip("'")
    return float(text) if "." in text else int(text)


def _weight(value: object) -> int:
    """About the bytes a parameter value takes in the request."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_weight(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_weight(v) for v in value)
    return 8


def _check_cells(rows: Sequence[Mapping[str, Any]]) -> None:
    for row in rows:
        for value in row.values():
            if isinstance(value, str | bytes) and len(value) > MAX_CELL_BYTES:
                raise issues.BadRequest(
                    f"Row cell size of {len(value)} bytes is larger than the allowed"
                    f" threshold {MAX_CELL_BYTES}"
                )


def _members(type_text: str) -> dict[str, str]:
    """The members of ``List<Struct<a:Utf8,b:Int32?>>``: name -> type."""
    found = re.fullmatch(r"List<Struct<(.*)>>", type_text)
    if found is None:
        raise issues.GenericError(f"AS_TABLE takes a list of structs, got {type_text}")
    return dict(part.split(":", 1) for part in found.group(1).split(","))


@dataclass
class FakeYdb:
    """One database; ``pool()`` is what the store gets instead of a ``QuerySessionPool``."""

    undetermined_commits: int = 0
    part_rows: int = 2  # rows per streamed part of a result set
    immediate_effects: bool = True  # False: a server that refuses reads of its own writes
    lose_result_sets: bool = False  # answer no result set at all, as no server should
    statements: list[str] = field(default_factory=list)
    tables: dict[str, Table] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None)
        self.db.create_function("ydb_contains", 2, _contains, deterministic=True)
        self.db.create_function("ydb_ascii_lower", 1, _ascii_lower, deterministic=True)
        self.db.create_function("ydb_substring", 3, _substring, deterministic=True)
        self.db.create_aggregate("COUNT_IF", 1, _CountIf)
        self.lock = asyncio.Lock()  # one transaction at a time: serializable by construction

    def pool(self) -> FakePool:
        return FakePool(self)

    # --- statements -------------------------------------------------------------

    def run(
        self,
        text: str,
        params: Mapping[str, ydb.TypedValue] | None,
        modified: set[str] | None = None,
    ) -> list[ResultSet]:
        """Runs a statement (DECLAREs, then statements separated by ``;``); ``modified``:
        the tables its transaction has changed so far (updated here)."""
        self.statements.append(text)
        params = dict(params or {})
        declared = dict(re.findall(r"DECLARE (\$\w+) AS ([^;]+);", text))
        body = re.sub(r"DECLARE \$\w+ AS [^;]+;\n?", "", text)
        self._check_params(body, declared, params)
        sent = sum(_weight(typed.value) for typed in params.values()) + len(text)
        if sent > MAX_MESSAGE_BYTES:
            raise issues.BadRequest(
                f"Sent message larger than max ({sent} vs. {MAX_MESSAGE_BYTES})"
            )
        if body.lstrip().startswith(("CREATE TABLE", "ALTER TABLE")):
            self._schema(body)
            return []
        named: dict[str, str] = {}
        answers: list[ResultSet] = []
        modified = set() if modified is None else modified
        for statement in (s.strip() for s in re.split(r";\s*(?:\n|$)", body)):
            if not statement:
                continue
            self._check_effects(statement, modified)
            if found := re.fullmatch(r"\$(\w+) = (SELECT .*)", statement, re.S):
                named[found.group(1)] = found.group(2)
            elif statement.startswith("SELECT"):
                rows = self._select(statement, named, params)
                if not self.lose_result_sets:
                    answers.append(ResultSet(len(answers), rows))
            else:
                self._write(statement, params)
        return answers

    def _check_effects(self, statement: str, modified: set[str]) -> None:
        """The server's refusals without immediate effects, in statement order."""
        target = re.match(
            r"(?:UPSERT INTO|REPLACE INTO|INSERT INTO|UPDATE|DELETE FROM) `([^`]+)`", statement
        )
        rest = statement[target.end() :] if target else statement
        if not self.immediate_effects:
            for table in re.findall(r"(?:FROM|JOIN) `([^`]+)`", rest):
                if table in modified:
                    raise issues.GenericError(
                        f"Data modifications previously made to table '{table}' in current"
                        " transaction won't be seen by operation: 'Select'"
                    )
            if target and target.group(1) in modified and self._table(target.group(1)).indexes:
                raise issues.GenericError(
                    "Multiple modification of table with secondary indexes is not supported yet"
                )
        if target:
            modified.add(target.group(1))

    def _check_params(
        self, body: str, declared: Mapping[str, str], params: Mapping[str, ydb.TypedValue]
    ) -> None:
        used = set(re.findall(r"\$p\d+", body))
        for name in used:
            if name not in declared:
                raise issues.GenericError(f"Unknown name: {name}")
        for name, type_text in declared.items():
            if name not in params:
                raise issues.GenericError(f"Missing value for parameter: {name}")
            if str(params[name].value_type) != type_text:
                raise issues.GenericError(
                    f"Parameter {name} declared {type_text}, sent {params[name].value_type}"
                )
        to_protobuf(params)

    def _schema(self, ddl: str) -> None:
        if found := re.match(r"ALTER TABLE `([^`]+)`", ddl):
            if found.group(1) not in self.tables:
                raise issues.SchemeError(f"Cannot find table '{found.group(1)}'")
            return
        found = re.match(r"CREATE TABLE IF NOT EXISTS `([^`]+)` \((.*)\)\s*$", ddl, re.S)
        if found is None:
            raise issues.GenericError(f"fake YDB: a DDL it does not know: {ddl}")
        path, inside = found.groups()
        if path in self.tables:
            return
        table = Table(path, {}, set(), [], set())
        for line in (part.strip().rstrip(",") for part in inside.splitlines()):
            if not line:
                continue
            if key := re.fullmatch(r"PRIMARY KEY \((.*)\)", line):
                table.primary_key = re.findall(r"`(\w+)`", key.group(1))
            elif index := re.fullmatch(r"INDEX (\w+) GLOBAL SYNC ON \((.*)\)", line):
                table.indexes.add(index.group(1))
            elif column := re.fullmatch(r"`(\w+)` (\w+)( NOT NULL)?", line):
                table.columns[column.group(1)] = column.group(2)
                if column.group(3):
                    table.not_null.add(column.group(1))
            else:
                raise issues.GenericError(f"fake YDB: a column it does not know: {line}")
        columns = ", ".join(
            f'"{name}"' + (" NOT NULL" if name in table.not_null else "") for name in table.columns
        )
        keys = ", ".join(f'"{name}"' for name in table.primary_key)
        self.db.execute(f'CREATE TABLE "{path}" ({columns}, PRIMARY KEY ({keys}))')
        self.tables[path] = table

    def _table(self, path: str) -> Table:
        if path not in self.tables:
            raise issues.SchemeError(f"Cannot find table '{path}'")
        return self.tables[path]

    def _select(
        self, statement: str, named: Mapping[str, str], params: Mapping[str, ydb.TypedValue]
    ) -> list[dict[str, Any]]:
        used = [name for name in named if f"${name}" in statement]
        # A named expression may use another: take them all, in order.
        prefix = ", ".join(f"{name} AS ({self._translate(named[name], params)})" for name in named)
        sql = self._translate(statement, params)
        if used:
            sql = f"WITH {prefix} {sql}"
        cursor = self.db.execute(sql, self._values(params))
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor]

    def _translate(self, sql: str, params: Mapping[str, ydb.TypedValue]) -> str:
        def view(found: re.Match[str]) -> str:
            if found.group(2) not in self._table(found.group(1)).indexes:
                raise issues.GenericError(f"Index {found.group(2)} not found in {found.group(1)}")
            return f"`{found.group(1)}`"

        sql = re.sub(r"`([^`]+/[^`]+)` VIEW (\w+)", view, sql)
        for path in re.findall(r"`([^`]+/[^`]+)`", sql):
            self._table(path)
        sql = sql.replace("String::Contains(", "ydb_contains(")
        sql = sql.replace("String::AsciiToLower(", "ydb_ascii_lower(")
        sql = sql.replace("Substring(", "ydb_substring(")
        if grouped := re.search(r"GROUP BY (.*) AS (\w+)$", sql):
            expression, alias = grouped.groups()
            sql = sql[: grouped.start()] + "GROUP BY 1"
            sql = sql.replace(f"SELECT {alias},", f"SELECT {expression} AS {alias},", 1)
        sql = re.sub(
            r"LEFT ONLY JOIN (.*) ON (\w+)\.(\w+) = (\w+)\.(\w+)$",
            r"LEFT JOIN \1 ON \2.\3 = \4.\5 WHERE \4.\5 IS NULL",
            sql,
        )

        def parameter(found: re.Match[str]) -> str:
            name = found.group(0)
            if name in params:
                if str(params[name].value_type).startswith("List<"):
                    return f"(SELECT value FROM json_each(:{name[1:]}))"
                return f":{name[1:]}"
            return name[1:]  # a named expression, now a WITH

        return re.sub(r"\$\w+", parameter, sql)

    @staticmethod
    def _values(params: Mapping[str, ydb.TypedValue]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, typed in params.items():
            value = typed.value
            if str(typed.value_type).startswith("List<") and not str(typed.value_type).startswith(
                "List<Struct"
            ):
                value = json.dumps(value)
            elif isinstance(value, list):
                continue  # AS_TABLE rows: read by _write
            values[name[1:]] = value
        return values

    def _write(self, statement: str, params: Mapping[str, ydb.TypedValue]) -> None:
        if found := re.fullmatch(
            r"(UPSERT|REPLACE|INSERT) INTO `([^`]+)` SELECT \* FROM AS_TABLE\((\$\w+)\)", statement
        ):
            verb, path, rows = found.groups()
            table = self._table(path)
            members = _members(str(params[rows].value_type))
            self._check_members(table, members, whole=True)
            self._upsert(table, list(members), params[rows].value, replace=verb != "UPSERT")
        elif found := re.fullmatch(r"UPSERT INTO `([^`]+)` \((.*)\) VALUES \((.*)\)", statement):
            path, names_text, values_text = found.groups()
            table = self._table(path)
            names = re.findall(r"`(\w+)`", names_text)
            missing = table.not_null - set(names)
            if missing:
                raise issues.GenericError(
                    f"Missing not null column in input: {', '.join(sorted(missing))}"
                )
            values = [v.strip() for v in values_text.split(",")]
            row = {
                name: params[v].value if v.startswith("$") else _literal(v)
                for name, v in zip(names, values, strict=True)
            }
            self._upsert(table, names, [row], replace=False)
        elif found := re.fullmatch(
            r"UPSERT INTO `([^`]+)` \(([^)]*)\) (SELECT .*)", statement, re.S
        ):
            path, names_text, select = found.groups()
            table = self._table(path)
            names = re.findall(r"`(\w+)`", names_text)
            missing = table.not_null - set(names)
            if missing:
                raise issues.GenericError(
                    f"Missing not null column in input: {', '.join(sorted(missing))}"
                )
            rows = self._select(select, {}, params)
            for row in rows:
                if list(row) != names:
                    raise issues.GenericError(
                        f"fake YDB: the SELECT names {list(row)}, the UPSERT {names}"
                    )
                if any(row[name] is None for name in table.not_null):
                    raise issues.GenericError("NULL in a not null column")
            self._upsert(table, names, rows, replace=False)
        elif found := re.fullmatch(r"UPDATE `([^`]+)` SET (.*) WHERE (.*)", statement, re.S):
            path, assignments_text, _ = found.groups()
            table = self._table(path)
            for name in re.findall(r"(\w+) = ", assignments_text):
                if name not in table.columns:
                    raise issues.GenericError(f"No such column: {name} in {path}")
                if name in table.primary_key:
                    raise issues.GenericError(f"Cannot update primary key column: {name}")
            self.db.execute(self._translate(statement, params), self._values(params))
        elif found := re.fullmatch(r"DELETE FROM `([^`]+)` WHERE (.*)", statement, re.S):
            self._table(found.group(1))
            self.db.execute(self._translate(statement, params), self._values(params))
        elif found := re.fullmatch(
            r"UPDATE `([^`]+)` ON SELECT \* FROM AS_TABLE\((\$\w+)\)", statement
        ):
            path, rows = found.groups()
            table = self._table(path)
            members = _members(str(params[rows].value_type))
            self._check_members(table, members, whole=False)
            changed = [name for name in members if name not in table.primary_key]
            where = " AND ".join(f'"{k}" = :{k}' for k in table.primary_key)
            assignments = ", ".join(f'"{name}" = :{name}' for name in changed)
            _check_cells(params[rows].value)
            for row in params[rows].value:
                self.db.execute(f'UPDATE "{path}" SET {assignments} WHERE {where}', row)
        elif found := re.fullmatch(
            r"DELETE FROM `([^`]+)` ON SELECT (.*) FROM AS_TABLE\((\$\w+)\)", statement
        ):
            path, _, rows = found.groups()
            table = self._table(path)
            members = _members(str(params[rows].value_type))
            self._check_members(table, members, whole=False)
            where = " AND ".join(f'"{k}" = :{k}' for k in table.primary_key)
            for row in params[rows].value:
                self.db.execute(f'DELETE FROM "{path}" WHERE {where}', row)
        else:
            raise issues.GenericError(f"fake YDB: a statement it does not know: {statement}")

    @staticmethod
    def _check_members(table: Table, members: Mapping[str, str], *, whole: bool) -> None:
        for name, member_type in members.items():
            if name not in table.columns:
                raise issues.GenericError(f"No such column: {name} in {table.path}")
            if member_type.rstrip("?") != table.columns[name] or (
                member_type.endswith("?") and name in table.not_null
            ):
                raise issues.GenericError(
                    f"Failed to convert type: {member_type} to the column {name}"
                    f" ({table.columns[name]}{' NOT NULL' if name in table.not_null else ''})"
                )
        missing = (table.not_null if whole else set(table.primary_key)) - set(members)
        if missing:
            what = "not null column" if whole else "key column"
            raise issues.GenericError(
                f"Missing {what} in input: {', '.join(sorted(missing))}."
                " All not null columns should be initialized"
            )

    def _upsert(
        self,
        table: Table,
        names: Sequence[str],
        rows: Sequence[Mapping[str, Any]],
        *,
        replace: bool,
    ) -> None:
        _check_cells(rows)
        columns = ", ".join(f'"{n}"' for n in names)
        values = ", ".join(f":{n}" for n in names)
        keys = ", ".join(f'"{k}"' for k in table.primary_key)
        if replace:
            sql = f'INSERT OR REPLACE INTO "{table.path}" ({columns}) VALUES ({values})'
        else:
            updates = ", ".join(
                f'"{n}" = excluded."{n}"' for n in names if n not in table.primary_key
            )
            sql = (
                f'INSERT INTO "{table.path}" ({columns}) VALUES ({values})'
                f" ON CONFLICT ({keys}) DO " + (f"UPDATE SET {updates}" if updates else "NOTHING")
            )
        for row in rows:
            self.db.execute(sql, dict(row))


class FakeTx:
    """The transaction ``retry_tx_async`` hands the store's callee."""

    def __init__(self, database: FakeYdb) -> None:
        self._database = database
        self.wrote = False
        self.modified: set[str] = set()  # the tables this transaction changed

    async def execute(
        self, query: str, parameters: Mapping[str, ydb.TypedValue] | None = None
    ) -> AsyncIterator[ResultSet]:
        if re.search(r"^\s*(UPSERT|REPLACE|INSERT|UPDATE|DELETE)", query, re.M):
            self.wrote = True
        answers = self._database.run(query, parameters, self.modified)

        async def stream() -> AsyncIterator[ResultSet]:
            for answer in answers:
                for part in answer.parts(self._database.part_rows):
                    yield part

        return stream()


class FakePool:
    """The two calls of ``QuerySessionPool`` the store makes, over a ``FakeYdb``."""

    def __init__(self, database: FakeYdb) -> None:
        self.database = database

    async def execute_with_retries(
        self,
        query: str,
        parameters: Mapping[str, ydb.TypedValue] | None = None,
        retry_settings: ydb.RetrySettings | None = None,
    ) -> list[ResultSet]:
        async def once() -> list[ResultSet]:
            async with self.database.lock:
                db = self.database.db
                db.execute("BEGIN")
                try:
                    answers = self.database.run(query, parameters)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                parts = [part for a in answers for part in a.parts(self.database.part_rows)]
                # The SDK's pool joins the streamed parts itself.
                return _join(parts)

        return cast(list[ResultSet], await _retry(once, retry_settings or ydb.RetrySettings()))

    async def retry_tx_async(
        self,
        callee: Callable[[FakeTx], Awaitable[Any]],
        tx_mode: object = None,
        retry_settings: ydb.RetrySettings | None = None,
    ) -> Any:
        async def once() -> Any:
            async with self.database.lock:
                db = self.database.db
                tx = FakeTx(self.database)
                db.execute("BEGIN")
                try:
                    result = await callee(tx)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                if tx.wrote and self.database.undetermined_commits > 0:
                    self.database.undetermined_commits -= 1
                    raise issues.Undetermined("the commit's outcome is unknown (fake)")
                return result

        return await _retry(once, retry_settings or ydb.RetrySettings())

    async def stop(self) -> None:
        return None
