"""schemathesis against pie serve's /openapi.json: requests generated from the document (valid and
invalid, a fixed seed, a bounded number per operation) never get a 5xx or a status the document
does not list, and every response has a documented content type."""
from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

from serve_helpers import idle, start

EXAMPLES = 8                          # per operation
ALIAS_EXAMPLES = 3                    # per alias of a Gemini route (the same handler without v1beta/)
# Generated requests that reach the model decode a few tokens only, so the run stays short
TOKEN_LIMITS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "top_logprobs": 2}
GEMINI_LIMITS = {"maxOutputTokens": 4, "candidateCount": 2}


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir) as s:
        yield s


def operations(server) -> list[schemathesis.APIOperation]:
    return [result.ok() for result in schemathesis.openapi.from_url(server.url + "/openapi.json").get_all_operations()]


def _cap(fields: dict, limits: dict) -> None:
    for key, limit in limits.items():
        value = fields.get(key)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit):
            fields[key] = limit


def bounded(case: schemathesis.Case) -> None:
    """Aim the request at the served model (an unknown one stops at a 404 before any endpoint runs),
    and keep what it may generate small."""
    if isinstance(case.path_parameters, dict) and "model" in case.path_parameters:
        case.path_parameters["model"] = "default"
    body = case.body
    if not isinstance(body, dict) or case.method != "POST":
        return
    if "model" in body:
        body["model"] = "default"
    if case.path.endswith(("/chat/completions", "/completions", "/messages")):
        _cap(body, TOKEN_LIMITS)
    elif case.path.endswith("/responses"):
        _cap(body, {"max_output_tokens": 4})
    elif case.path.endswith("generateContent"):
        config = body.get("generationConfig")
        if not isinstance(config, dict):
            config = body["generationConfig"] = {}
        _cap(config, GEMINI_LIMITS)


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda mode: mode.value)
def test_no_5xx_and_only_documented_statuses(server, mode):
    """Both modes: requests of the documented shapes, and requests that break them."""
    checks = [not_a_server_error, status_code_conformance, content_type_conformance]
    for operation in operations(server):
        if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue                  # no body, at most a string in the path: no request to it is invalid
        alias = ":" in operation.path and not operation.path.startswith("/v1beta/")
        # one hypothesis run per operation (schemathesis' pytest plugin does the same through private
        # pytest attributes that pytest 9 no longer has)
        @hypothesis.seed(20261201)
        @hypothesis.settings(max_examples=ALIAS_EXAMPLES if alias else EXAMPLES, deadline=None, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck),
                             phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
        @hypothesis.given(operation.as_strategy(generation_mode=mode))
        def requests(case: schemathesis.Case) -> None:
            bounded(case)
            case.call_and_validate(base_url=server.url, timeout=120, checks=checks)

        requests()


def test_the_server_is_idle_after_it(server):
    for saved in server.runtime.saved(None):          # the stored responses' working sets, kept on purpose
        server.runtime.delete_saved(saved["name"])
    assert idle(server)["kv"]["referenced"] == 0
