"""Onboarding: from zero to a first delivered message without the platform team.

- ``templates``: ``nemesis new handler`` (a runnable handler project with
  tests, HTTP or gRPC) and ``nemesis new integration`` (a commented YAML that
  validates);
- ``probe``: ``nemesis check-handler URL``, which tells whether a handler
  follows the contract;
- ``rules``: the pull-request rules ``nemesis validate`` adds across files
  (owners, naming, one consumer per integration, target URLs, secrets);
- ``schema``: ``nemesis schema``, JSON Schema for editors;
- ``commands``: the argparse side of the above.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemesis.onboarding.rules import IntegrationRulesChecker

__all__ = ["IntegrationRulesChecker"]


def __getattr__(name: str) -> Any:
    # The rules load the config models: imported when asked for, so that the CLI's
    # parser (nemesis.onboarding.commands) loads none of them.
    if name == "IntegrationRulesChecker":
        from nemesis.onboarding.rules import IntegrationRulesChecker

        return IntegrationRulesChecker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
