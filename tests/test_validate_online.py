"""``nemesis validate --online``: topics, consumer names and owners checked against a real broker.

The real CLI in a subprocess, against the embedded backend and a real Kafka
(tests/kafka_broker.py): a missing topic, a consumer name another reader
holds and an owner no team in ``auth:`` names are each reported at their
line; an integration already registered on its topic is fine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Workspace
from tests.kafka_broker import KafkaBroker, Namespace

TEAMS = "auth: {admin_teams: [team-shop, team-billing]}\n"


def integration(name: str, topic: str, consumer: str, owner: str = "team-shop") -> str:
    return (
        f"name: {name}\n"
        f"owners: [{owner}]\n"
        "source:\n"
        f"  topic: {topic}\n"
        f"  consumer: {consumer}\n"
        "target: {url: 'http://127.0.0.1:9/hook'}\n"
    )


def configure(workspace: Workspace, backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "kafka":
        kafka: KafkaBroker = request.getfixturevalue("kafka")
        (workspace.root / "nemesis.yaml").write_text(
            "backend:\n"
            "  kind: kafka\n"
            f"  bootstrap_servers: ['{kafka.bootstrap}']\n"
            "single_host: true\n"
            "data_dir: .\n"
            "integrations_dir: integrations\n" + TEAMS
        )
        (workspace.root / "integrations").mkdir(exist_ok=True)
    else:
        workspace.write_config(TEAMS)


@pytest.mark.parametrize("backend", ["embedded", "kafka"])
def test_online_catches_a_missing_topic_a_taken_consumer_and_an_unknown_team(
    workspace: Workspace, backend: str, request: pytest.FixtureRequest
) -> None:
    configure(workspace, backend, request)
    ns = Namespace()
    orders, payments, missing = ns("orders"), ns("payments"), ns("nowhere")
    for topic, consumer in ((orders, ns("loyalty")), (payments, ns("payments-reader"))):
        done = workspace.cli("topics", "create", topic, "--consumer", consumer, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    write = workspace.write_integration
    # Already registered on its topic (a running integration's own consumer), and a new one.
    write("loyalty", integration("loyalty", orders, ns("loyalty")))
    write("fresh", integration("fresh", orders, ns("fresh"), owner="team-billing"))
    write("lost", integration("lost", missing, ns("lost")))
    write("thief", integration("thief", orders, ns("payments-reader")))
    write("stranger", integration("stranger", orders, ns("stranger"), owner="team-shops"))

    offline = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert offline.returncode == 0, offline.stdout + offline.stderr
    done = workspace.cli("validate", "--online", "nemesis.yaml", "integrations", timeout=120)

    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"integrations/lost.yaml:4: source.topic: topic {missing!r} does not exist on the"
        " broker: create it first, or check the name",
        "integrations/stranger.yaml:2: owners.0: 'team-shops' is not a known team (did you mean"
        " team-shop?): the teams are those nemesis.yaml names in auth (users' and tokens'"
        " teams, admin_teams)",
        f"integrations/thief.yaml:5: source.consumer: consumer {ns('payments-reader')!r} is"
        f" taken: it reads {payments} on the broker; give the integration a consumer name of"
        " its own",
    ], done.stdout


def test_online_needs_the_process_file(tmp_path: Path) -> None:
    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "a.yaml").write_text(integration("a", "orders", "a"))
    done = Workspace(tmp_path).cli("validate", "--online", "integrations")
    assert done.returncode == 1
    assert "--online needs the process configuration" in done.stdout
