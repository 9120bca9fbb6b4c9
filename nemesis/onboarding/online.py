"""``nemesis validate --online``: the registration checks that need the broker and the teams.

With read-only credentials for the process file's backend (list topics,
describe them and their consumers' committed offsets; nothing is created or
committed), each loaded integration is checked for:

- its source topic exists (``source.topic``); a queue source (``kind: sqs``)
  instead has its queue looked up where ``source:`` says, with the AWS
  chain's credentials (a queue that does not exist, credentials refused);
- its consumer name is free or already this integration's
  (``source.consumer``): taken when the broker knows it on a topic other
  than the integration's source (committed offsets there), or it has live
  readers while it has none on the source (a Kafka group whose members read
  other topics). Nemesis's own ``nemesis.*`` topics are left out: their
  consumers are Nemesis's;
- its owners are known teams (``owners``): named in ``auth:`` (a user's or a
  token's ``teams``, or ``admin_teams``). When ``auth:`` names no team at
  all (teams come only from an SSO proxy's header), owners are not checked.

Every problem points at the integration file's line; a backend that cannot
be reached is one problem at the process file.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path

from nemesis.broker.port import Broker, DescribesMany, TopicDescription
from nemesis.config.loader import ValidationContext, read_yaml
from nemesis.config.models import AuthConfig, IntegrationConfig, NemesisConfig
from nemesis.errors import BrokerAccessDenied, ConfigProblem, NemesisError, TopicNotFound
from nemesis.onboarding.rules import INTERNAL_PREFIX


def declared_teams(auth: AuthConfig) -> set[str]:
    """The teams ``auth:`` names: users', tokens' and the admin teams."""
    return {
        *auth.admin_teams,
        *(team for user in auth.users for team in user.teams),
        *(team for token in auth.tokens for team in token.teams),
    }


class OnlineChecker:
    """Source topics, consumer names and owners against the broker and the declared teams."""

    def claims(self, path: Path) -> bool:
        """Claims nothing: it checks what the core loaded."""
        return False

    def check(self, paths: Sequence[Path], context: ValidationContext) -> list[ConfigProblem]:
        """Every integration against each process file's backend and teams."""
        if not context.process_configs:
            return [
                ConfigProblem(
                    "nemesis.yaml",
                    None,
                    None,
                    "--online needs the process configuration for its backend and teams:"
                    " name it among the paths (nemesis validate --online nemesis.yaml"
                    " integrations), or run where ./nemesis.yaml is",
                )
            ]
        problems: list[ConfigProblem] = []
        for process_file, config in sorted(context.process_configs.items()):
            problems.extend(asyncio.run(self._check(process_file, config, context)))
        return problems

    async def _check(
        self, process_file: Path, config: NemesisConfig, context: ValidationContext
    ) -> list[ConfigProblem]:
        integrations = context.integrations.integrations
        checks = _Checks(context)
        teams = declared_teams(config.auth)
        if teams:
            for name, integration in sorted(integrations.items()):
                checks.owners(name, integration, teams, process_file)
        from nemesis.backends import open_backend

        try:
            broker = await open_backend(config)
        except (NemesisError, OSError) as exc:
            checks.problems.append(
                ConfigProblem(str(process_file), None, "backend", f"cannot reach it: {exc}")
            )
            return checks.problems
        try:
            described = await _describe_all(broker)
            for name, integration in sorted(integrations.items()):
                if integration.source.on_backend:
                    await checks.source(broker, name, integration, described)
                else:
                    await checks.queue(name, integration)
        except NemesisError as exc:
            checks.problems.append(
                ConfigProblem(
                    str(process_file),
                    None,
                    "backend",
                    f"the checks could not finish: {exc} (the credentials need to list and"
                    " describe topics and consumer groups)",
                )
            )
        finally:
            await broker.close()
        return checks.problems


async def _describe_all(broker: Broker) -> dict[str, TopicDescription]:
    """Every topic but Nemesis's own, described (in one trip where the admin can)."""
    admin = broker.admin
    names = [t for t in await admin.list_topics() if not t.startswith(INTERNAL_PREFIX)]
    if isinstance(admin, DescribesMany):
        return dict(await admin.describe_topics(names))
    return {name: await admin.describe_topic(name) for name in names}


class _Checks:
    def __init__(self, context: ValidationContext) -> None:
        self.context = context
        self.problems: list[ConfigProblem] = []
        self._lines: dict[str, Mapping[tuple[object, ...], int]] = {}

    def report(self, name: str, path: tuple[str | int, ...], message: str) -> None:
        file = self.context.integration_files.get(name)
        where = str(file) if file is not None else f"integration {name}"
        self.problems.append(
            ConfigProblem(where, self._line(name, path), ".".join(map(str, path)), message)
        )

    def owners(
        self, name: str, integration: IntegrationConfig, teams: set[str], process_file: Path
    ) -> None:
        for index, owner in enumerate(integration.owners):
            if owner in teams:
                continue
            close = difflib.get_close_matches(owner, sorted(teams), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            self.report(
                name,
                ("owners", index),
                f"{owner!r} is not a known team{hint}: the teams are those {process_file}"
                " names in auth (users' and tokens' teams, admin_teams)",
            )

    async def source(
        self,
        broker: Broker,
        name: str,
        integration: IntegrationConfig,
        described: Mapping[str, TopicDescription],
    ) -> None:
        topic, consumer = integration.source.topic, integration.source.consumer
        if topic not in described:
            self.report(
                name,
                ("source", "topic"),
                f"topic {topic!r} does not exist on the broker: create it first, or check the name",
            )
        elsewhere = sorted(
            other
            for other, description in described.items()
            if other != topic and consumer in description.consumers
        )
        if elsewhere:
            self.report(
                name,
                ("source", "consumer"),
                f"consumer {consumer!r} is taken: it reads {', '.join(elsewhere[:3])}"
                + (f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else "")
                + " on the broker; give the integration a consumer name of its own",
            )
            return
        own = described.get(topic)
        if own is None or consumer in own.consumers:
            return
        if await broker.admin.live_readers(topic, consumer):
            self.report(
                name,
                ("source", "consumer"),
                f"consumer {consumer!r} is taken: it has live readers on the broker that do not"
                f" read {topic!r}; give the integration a consumer name of its own",
            )

    async def queue(self, name: str, integration: IntegrationConfig) -> None:
        """A queue source's queue exists and the AWS chain's credentials may read it."""
        from nemesis.backends.sqs import SqsSourceConfig

        source = integration.source
        if not isinstance(source, SqsSourceConfig):
            return  # a kind with no online check of its own
        field = "queue" if source.queue is not None else "queue_url"
        try:
            from nemesis.broker.sqs import describe_queue
        except ImportError:
            self.report(name, ("source",), "checking a queue needs aiobotocore: pip install"
                        " 'nemesis[sqs]'")  # fmt: skip
            return
        try:
            await describe_queue(source)
        except TopicNotFound as exc:
            self.report(name, ("source", field), f"{exc}: create it first, or check the name")
        except BrokerAccessDenied as exc:
            self.report(
                name,
                ("source",),
                f"{exc} (the credentials need sqs:GetQueueUrl and sqs:GetQueueAttributes)",
            )
        except NemesisError as exc:
            self.report(name, ("source", "endpoint_url"), f"cannot reach the queue: {exc}")

    def _line(self, name: str, path: tuple[str | int, ...]) -> int | None:
        if name not in self._lines:
            file = self.context.integration_files.get(name)
            document = (
                None if file is None else read_yaml(file, env=self.context.env, require_env=False)
            )
            self._lines[name] = {} if document is None else dict(document.lines)
        lines = self._lines[name]
        for end in range(len(path), -1, -1):
            line = lines.get(path[:end])
            if line is not None:
                return line
        return None
