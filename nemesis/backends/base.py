"""What a backend kind is: a config model and a factory, registered together by name.

``BackendModel``, ``DlqModel`` and ``StateModel`` are the bases of the
``backend:``, ``dlq:`` and ``state:`` sections' models, and ``SourceModel``
that of an integration's ``source:`` block: what every kind has, so the CLI
and the runner can read it whatever the kind. ``Backends`` is the registry;
see ``nemesis.backends`` for how a kind joins it.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Protocol, Union

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import InitErrorDetails, PydanticCustomError

from nemesis.config_base import DurationS, Model

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.broker.source import Source
    from nemesis.clock import Clock
    from nemesis.dlq.port import DeadLetterStore
    from nemesis.fleet.port import StateStore

TOPIC_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$"
# A source topic may also be an absolute path (YDB: /<database>/<path>, a topic
# outside the backend's directory); topics Nemesis creates are always relative.
SOURCE_TOPIC_PATTERN = r"^/?[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$"


class BackendModel(Model):
    """The ``backend:`` section of one kind; every kind has these fields."""

    kind: str
    retention: DurationS  # of a topic created without one
    default_partitions: int  # of a topic created without a count

    # Whether processes on other hosts can read the same topics (Kafka, YDB), so that a
    # fleet may span hosts; the embedded broker is one file, read from one host only.
    spans_hosts: ClassVar[bool] = True

    def consumer_name_problem(self, name: str) -> str | None:
        """Why this kind's broker refuses ``name`` as a consumer name; None if it takes it.

        ``nemesis validate`` reports it at the integration's ``source.consumer``
        when it validates a process file of this kind with the integrations.
        """
        return None


class DlqModel(Model):
    """The ``dlq:`` section of one kind."""

    kind: str
    retention: DurationS  # rows older than this are deleted; 0 keeps them forever

    # Whether only the processes of one host reach the store (a file): such a store
    # cannot serve a fleet whose broker spans hosts (``nemesis.config.models``).
    per_host: ClassVar[bool] = False

    def location(self, data_dir: str) -> str:
        """Where the store is, in words (``nemesis init`` prints it)."""
        return self.kind

    def check_backend(self, backend: BackendModel) -> None:
        """Raises ValueError if this store cannot work with ``backend``."""


class StateModel(Model):
    """The ``state:`` section of one kind: where the replicas of a fleet meet."""

    kind: str
    # A member that stops renewing its lease for this long is taken for dead and its
    # integrations move; it renews every third of it.
    lease_s: Annotated[float, Field(ge=0.5, le=600)] = 10.0
    # How often a member asks whether anything changed (one small read).
    poll_s: Annotated[float, Field(gt=0, le=60)] = 1.0

    # As ``DlqModel.per_host``: a store only the processes of one host reach.
    per_host: ClassVar[bool] = False

    def location(self, data_dir: str) -> str:
        """Where the store is, in words."""
        return self.kind

    def check_backend(self, backend: BackendModel) -> None:
        """Raises ValueError if the store cannot work with ``backend`` (see ``DlqModel``)."""


# A producer header forwarded to the handler: an HTTP token, lowercase, and none that
# the contract or HTTP framing sets (docs/handler-contract.md, "Producer headers").
_FORWARDED_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
_NOT_FORWARDED = frozenset(
    {
        "content-type",
        "content-length",
        "transfer-encoding",
        "host",
        "connection",
        "te",
        "user-agent",
        "accept",
        "accept-encoding",
    }
)


def _check_forwarded(names: tuple[str, ...]) -> tuple[str, ...]:
    for name in names:
        if not _FORWARDED_NAME.fullmatch(name):
            raise ValueError(f"{name!r}: a header name is a lowercase HTTP token")
        if name.startswith(("ce-", "ce_", "nemesis-", "grpc-")) or name in _NOT_FORWARDED:
            raise ValueError(f"{name!r}: set by Nemesis or by HTTP itself, never forwarded")
        if name.endswith("-bin"):
            raise ValueError(f"{name!r}: -bin names are gRPC's binary metadata")
    if len(set(names)) != len(names):
        raise ValueError("a header is named twice")
    return names


class SourceModel(Model):
    """An integration's ``source:`` block of one kind; every kind has these fields.

    ``topic`` is the name the source goes by: its messages' ``topic``, the
    metrics' label and the origin recorded in retries and dead letters (a
    queue's name, for a queue). ``consumer`` names the integration on the
    process's log backend, whatever the source: its retry tiers and replay
    topic are read there as this consumer.
    """

    kind: str
    topic: Annotated[str, Field(pattern=SOURCE_TOPIC_PATTERN)]
    consumer: Annotated[str, Field(pattern=TOPIC_PATTERN)]
    # The metadata key that names a message's type (ce-type, flags.disabled_types).
    type_key: str = "type"
    # The producer's headers (Kafka headers, YDB and embedded metadata) a handler
    # receives as request headers (gRPC: metadata; docs/handler-contract.md). The W3C
    # trace context is always sent, continued or started (docs/tracing.md): naming
    # traceparent or tracestate here changes nothing.
    forward_headers: Annotated[tuple[str, ...], AfterValidator(_check_forwarded)] = ()

    # Whether the source is a topic of the process's own log backend (``backend:``): its
    # consumer is registered there and its commit lag watched there.
    on_backend: ClassVar[bool] = False
    # The longest delay for which the source can give a message back to come again
    # (``nemesis.broker.source.Releases``); None: it cannot, and its retries go to tier
    # topics. A source that can retries by release unless ``retry.via: topics``.
    max_release_delay_s: ClassVar[float | None] = None


@dataclass(frozen=True)
class SourceContext:
    """What a source factory is given besides its ``source:`` block."""

    integration: str
    broker: Broker  # the process's log backend (``backend:``): where retry tiers live
    clock: Clock


class ProcessConfig(Protocol):
    """What a factory reads of the process's configuration (``NemesisConfig`` has it).

    A protocol, so that the kinds need not import the configuration that
    imports them for its types.
    """

    @property
    def backend(self) -> BackendModel: ...

    @property
    def dlq(self) -> DlqModel: ...

    @property
    def state(self) -> StateModel: ...

    @property
    def data_dir(self) -> str: ...


BrokerFactory = Callable[[ProcessConfig, "Clock"], Awaitable["Broker"]]
DlqFactory = Callable[[ProcessConfig, "Broker | None", "Clock"], Awaitable["DeadLetterStore"]]
StateFactory = Callable[[ProcessConfig], Awaitable["StateStore"]]
# Opens an integration's source: its ``source:`` block (of the kind's model) and context.
SourceFactory = Callable[[SourceModel, SourceContext], Awaitable["Source"]]


@dataclass(frozen=True)
class BrokerKind:
    """A broker backend: its name (``backend.kind``), config model and factory."""

    name: str
    config: type[BackendModel]
    open: BrokerFactory


@dataclass(frozen=True)
class DlqKind:
    """A DLQ store: its name (``dlq.kind``), config model and factory."""

    name: str
    config: type[DlqModel]
    open: DlqFactory


@dataclass(frozen=True)
class StateKind:
    """A fleet state store: its name (``state.kind``), config model and factory."""

    name: str
    config: type[StateModel]
    open: StateFactory


@dataclass(frozen=True)
class SourceKind:
    """A source of an integration's messages: its name (``source.kind``), model and factory."""

    name: str
    config: type[SourceModel]
    open: SourceFactory


@dataclass
class Backends:
    """Broker, DLQ-store, state-store and source kinds by name; the first of each is the default."""

    brokers: dict[str, BrokerKind] = field(default_factory=dict)
    dlqs: dict[str, DlqKind] = field(default_factory=dict)
    states: dict[str, StateKind] = field(default_factory=dict)
    sources: dict[str, SourceKind] = field(default_factory=dict)

    def copy(self) -> Backends:
        return Backends(dict(self.brokers), dict(self.dlqs), dict(self.states), dict(self.sources))

    def register_broker(self, kind: BrokerKind) -> None:
        self.brokers[kind.name] = kind

    def register_dlq(self, kind: DlqKind) -> None:
        self.dlqs[kind.name] = kind

    def register_state(self, kind: StateKind) -> None:
        self.states[kind.name] = kind

    def register_source(self, kind: SourceKind) -> None:
        self.sources[kind.name] = kind

    def backend_config(self) -> Any:
        """The type of ``backend:``: one model per registered kind, chosen by ``kind``."""
        return _by_kind("backend", {name: kind.config for name, kind in self.brokers.items()})

    def dlq_config(self) -> Any:
        """The type of ``dlq:``: one model per registered kind, chosen by ``kind``."""
        return _by_kind("dlq", {name: kind.config for name, kind in self.dlqs.items()})

    def state_config(self) -> Any:
        """The type of ``state:``: one model per registered kind, chosen by ``kind``."""
        return _by_kind("state", {name: kind.config for name, kind in self.states.items()})

    def source_config(self) -> Any:
        """The type of an integration's ``source:``: one model per registered kind."""
        return _by_kind("source", {name: kind.config for name, kind in self.sources.items()})


_UNKNOWN = "?"  # the tag of a kind nobody registered


def _tag(kind: str) -> str:
    return f"kind={kind}"


def _by_kind(section: str, models: dict[str, type[Model]]) -> Any:
    """A union of ``models`` tagged by their ``kind``, for pydantic.

    A section without ``kind`` is the first model (the default kind). An
    unknown kind is reported at ``<section>.kind`` with the known kinds, and
    the section's other fields are still checked against the default
    kind's model, so one run reports every problem; that check is left out
    of the JSON schema, which lists the known kinds only.
    """
    if not models:
        raise ValueError(f"no {section} kind is registered")
    names = list(models)
    message = f"unknown {section} kind '{{kind}}'; the known kinds are {', '.join(names)}"

    def unknown_kind(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            problems: list[InitErrorDetails] = []
            for problem in exc.errors():
                if problem["loc"] == ("kind",):
                    kind = {"kind": problem["input"]}
                    error: Any = PydanticCustomError("unknown_kind", message, kind)
                else:
                    error = problem["type"]
                details = InitErrorDetails(type=error, loc=problem["loc"], input=problem["input"])
                if "ctx" in problem and not isinstance(error, PydanticCustomError):
                    details["ctx"] = problem["ctx"]
                problems.append(details)
            raise ValidationError.from_exception_data(exc.title, problems) from None

    # A member's tag is never a field's name: an error's location names the tag, and
    # the problem report walks the location through the data (a ``topic`` kind of a
    # section that has a ``topic`` field would send it down the wrong path).
    def kind_of(value: Any) -> str:
        kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
        if kind is None:
            return _tag(names[0])
        return _tag(kind) if kind in models else _UNKNOWN

    default: Any = models[names[0]]
    choices: list[Any] = [Annotated[model, Tag(_tag(name))] for name, model in models.items()]
    fallback: Any = Annotated[default, WrapValidator(unknown_kind), Tag(_UNKNOWN)]
    skip: Any = SkipJsonSchema  # built at run time: to mypy not a type
    choices.append(skip[fallback])
    return Annotated[Union[tuple(choices)], Discriminator(kind_of)]  # noqa: UP007
