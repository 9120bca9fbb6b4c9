"""Absolute topic paths on YDB: a source topic another team owns, outside the backend's directory.

A topic name that starts with ``/`` is a path in the database, used as it
is; any other name lives under ``<database>/<directory>``. The admin's
stand-in keeps topics by their full path, as the server does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import cast

import pytest
from ydb import TopicClientAsyncIO

from nemesis.broker.port import ConsumerSpec
from nemesis.broker.ydb import YdbAdmin
from nemesis.broker.ydb.connection import object_path
from nemesis.config.loader import load_integration_file
from nemesis.errors import BrokerError, ConfigError
from nemesis.onboarding.templates import IntegrationSpec, TemplateError, render_integration
from tests.test_ydb_admin import TopicService, lister


def test_a_name_starting_with_a_slash_is_a_path_of_its_own() -> None:
    assert object_path("/local", "nemesis", "/local/orders") == "/local/orders"
    assert object_path("/local/", "nemesis", "/local/shop/orders/") == "/local/shop/orders"
    assert object_path("/local", "nemesis", "orders") == "/local/nemesis/orders"


def test_an_absolute_name_outside_the_database_is_refused_by_name() -> None:
    with pytest.raises(BrokerError, match="/other/orders is outside the database /local"):
        object_path("/local", "nemesis", "/other/orders")
    with pytest.raises(BrokerError, match="outside the database"):
        object_path("/local", "nemesis", "/localother/orders")  # a prefix is not a parent


async def test_the_admin_reaches_another_teams_topic_where_it_is() -> None:
    service = TopicService()
    service.directories.add("/local/shop")
    admin = YdbAdmin(
        cast(TopicClientAsyncIO, service),
        lister({}),
        make_directory=service.make_directory,
        database="/local",
        directory="nemesis",
        default_retention_s=86400.0,
        timeout_s=1.0,
    )
    await admin.create_topic("/local/shop/orders", partitions=2)
    await admin.add_consumer("/local/shop/orders", ConsumerSpec("billing"))
    assert list(service.topics) == ["/local/shop/orders"]
    assert await admin.consumers("/local/shop/orders") == ["billing"]
    description = await admin.describe_topic("/local/shop/orders")
    assert description.name == "/local/shop/orders"


def test_an_integration_may_read_an_absolute_topic(tmp_path: Path) -> None:
    path = tmp_path / "orders.yaml"
    path.write_text(
        textwrap.dedent(
            """
            name: orders
            owners: [team-orders]
            source: {topic: /local/shop/orders, consumer: loyalty}
            target:
              url: http://127.0.0.1:9001/events/order
            """
        ),
        encoding="utf-8",
    )
    assert load_integration_file(path).source.topic == "/local/shop/orders"
    # A consumer is a name, never a path.
    path.write_text(path.read_text().replace("consumer: loyalty", "consumer: /loyalty"))
    with pytest.raises(ConfigError, match=r"source\.consumer"):
        load_integration_file(path)


def test_a_new_integration_may_name_an_absolute_topic(tmp_path: Path) -> None:
    spec = IntegrationSpec(name="orders-to-loyalty", topic="/local/shop/orders")
    path = tmp_path / "orders-to-loyalty.yaml"
    path.write_text(render_integration(spec), encoding="utf-8")
    assert load_integration_file(path).source.topic == "/local/shop/orders"
    with pytest.raises(TemplateError, match="consumer"):
        render_integration(IntegrationSpec(name="orders-to-loyalty", consumer="/loyalty"))
