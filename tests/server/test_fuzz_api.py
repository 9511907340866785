"""Fuzzing the HTTP API.

1. schemathesis, from the server's own ``/openapi.json``, against a real ``conveyor serve`` over
   loopback: every operation, with schemathesis' examples, coverage (boundary values, wrong types,
   unexpected methods) and fuzzing phases, positive and negative. No answer may be a 5xx, and every
   4xx (and every error event in a stream) must be OpenAI's error body
   ``{"error": {"message", "type", "param", "code"}}``. Then against a server started with
   ``--api-key``, with and without ``Authorization: Bearer KEY``: without it every ``/v1/*``
   answer is a 401 in that shape, while ``/health`` and ``/metrics`` stay open.
2. A few hand-made bodies over the same HTTP that JSON schemas cannot express (NaN, Infinity,
   lone surrogates, deep nesting, huge integers).
3. hypothesis-built JSON bodies fed to the request models in-process (no model, no server): a
   body either validates, or ``_validation_error`` turns pydantic's complaint into a 400
   ``APIError`` in OpenAI's shape; nothing else may be raised.

``-s`` prints how many schemathesis cases ran, per operation and status, and every failure with
its request, response and the server log around it. CONVEYOR_FUZZ_EXAMPLES sets the fuzzing
phase's examples per operation, CONVEYOR_FUZZ_SEED the seed (printed on each run; 0 unless set,
so that a run passes or fails as the last one did: another seed is another search).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import requests
import schemathesis
from fastapi.exceptions import RequestValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error
# schemathesis' own pytest loader (schemathesis.pytest.from_fixture) sets Item._nodeid, which
# pytest 9.2 no longer has; this is what it runs for each operation, minus that bookkeeping.
from schemathesis.pytest.lazy import get_all_tests
from server_process import ServerProcess

from conveyor.bench.client import sse_split
from conveyor.server.errors import APIError, _validation_error
from conveyor.server.protocol import NOT_IMPLEMENTED, ChatCompletionRequest, CompletionRequest
from conveyor.server.responses import to_chat
from conveyor.server.responses_protocol import RESPONSES_NOT_IMPLEMENTED, ResponsesRequest

pytestmark = pytest.mark.slow

# -- the live servers --------------------------------------------------------------------------
API_KEY = "fuzz-test-key-0123456789"
# A short context keeps every accepted request cheap: prompt and output together are at most
# MAX_MODEL_LEN tokens, whatever the body asks (chat without max_tokens runs up to the limit).
MAX_MODEL_LEN = 64
# One model thread: two on the 2 cores crawl (~1 token/s) as soon as anything else runs.
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--threads", "1"]
TOKEN_CAP = 8  # accepted bodies asking for more are lowered to these (see cap_generation)
N_CAP = 4
# The fuzzing phase's examples per operation; the examples and coverage phases add their own.
MAX_EXAMPLES = int(os.environ.get("CONVEYOR_FUZZ_EXAMPLES", "15"))
SEED = int(os.environ.get("CONVEYOR_FUZZ_SEED", "0"))
REQUEST_TIMEOUT_S = 120.0


def show(body: object) -> str:
    """A case's body as the JSON sent (non-ASCII escaped), or its repr when it is no JSON."""
    try:
        return json.dumps(body, ensure_ascii=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        try:
            return repr(body)
        except RecursionError:
            return f"<a {type(body).__name__} too deep to print>"


@dataclass
class Finding:
    target: str
    method: str
    path: str
    query: object
    body: object
    request_headers: dict
    status: int | None
    response: str
    problem: str
    server_log: str

    def key(self) -> tuple:
        return (self.target, self.method, self.path, self.status, self.problem.split("\n")[0])

    def describe(self) -> str:
        return (f"[{self.target}] {self.method} {self.path}  query={self.query!r}\n"
                f"   body: {show(self.body):.2000}\n   request headers: {self.request_headers}\n"
                f"   -> {self.status}: {self.response[:1500]}\n   problem: {self.problem[:1500]}\n"
                f"   server log:\n{self.server_log[-4000:]}")


class Server:
    """A ``conveyor serve`` that is started again (and the death recorded) if a case kills it."""

    def __init__(self, *args: str) -> None:
        self.args = [*SERVER_ARGS, *args]
        self.restarts = 0
        self.proc = self._start()

    def _start(self) -> ServerProcess:
        proc = ServerProcess(*self.args)
        try:
            proc.wait_ready()
        except BaseException:
            print(proc.log()[-4000:])
            proc.terminate()
            raise
        return proc

    @property
    def base_url(self) -> str:
        return self.proc.base_url

    def log(self) -> str:
        return self.proc.log()

    def log_size(self) -> int:
        return os.path.getsize(self.proc._log.name)

    def log_since(self, offset: int) -> str:
        with open(self.proc._log.name, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def dead(self) -> bool:
        return self.proc.proc.poll() is not None

    def _keep_log(self) -> None:
        """The whole log outlives the process (ServerProcess deletes its own)."""
        folder = os.path.dirname(LOGS[0]) if LOGS else tempfile.mkdtemp(prefix="conveyor-fuzz-")
        path = os.path.join(folder, f"serve-{self.proc.port}.log")
        with open(path, "w") as f:
            f.write(self.proc.log())
        LOGS.append(path)

    def restart(self) -> None:
        self._keep_log()
        self.proc.terminate()
        self.restarts += 1
        self.proc = self._start()

    def terminate(self) -> None:
        self._keep_log()
        self.proc.terminate()


@dataclass
class Target:
    """One fuzzing run: a server, and whether the requests carry its key."""

    name: str
    server: Server
    headers: dict[str, str] | None     # sent with every case
    schema_headers: dict[str, str]     # to fetch /openapi.json
    auth_required: bool                # the server has a key and the cases do not send it
    phases: tuple[str, ...]
    cases: Counter = field(default_factory=Counter)  # (operation, status) -> cases
    errors: Counter = field(default_factory=Counter)  # (operation, param, code) -> 4xx cases
    slowest: list = field(default_factory=list)  # (seconds, operation, status, body)
    seconds: float = 0.0
    seed: int = 0


LOGS: list[str] = []  # the servers' logs, kept
FINDINGS: dict[tuple, Finding] = {}
TARGETS: list[Target] = []


@pytest.fixture(scope="module")
def open_server():
    server = Server()
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def keyed_server():
    server = Server("--api-key", API_KEY)
    yield server
    server.terminate()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if not TARGETS:
        return
    total = sum(sum(t.cases.values()) for t in TARGETS)
    print(f"\n== schemathesis {schemathesis.__version__} against conveyor serve "
          f"(CONVEYOR_FUZZ_SEED={SEED}), {MAX_EXAMPLES} fuzzing examples per operation")
    for t in TARGETS:
        print(f"-- {t.name} ({'+'.join(t.phases)}, seed {t.seed}): {sum(t.cases.values())} "
              f"cases in {t.seconds:.0f} s; server restarts: {t.server.restarts}")
        by_op: dict[str, list[str]] = {}
        for (op, status), count in sorted(t.cases.items()):
            by_op.setdefault(op, []).append(f"{status} x{count}")
        # the coverage phase's one case per undocumented method, on one line
        odd = sorted(op for op, counts in by_op.items() if len(counts) == 1 and
                     counts[0].endswith(" x1") and counts[0][:3] in ("405", "401"))
        for op, counts in by_op.items():
            if op not in odd:
                print(f"   {op:36s} {', '.join(counts)}")
        if odd:
            statuses = Counter(by_op[op][0][:3] for op in odd)
            print(f"   {len(odd)} undocumented method+path pairs, one case each: "
                  + ", ".join(f"{status} x{n}" for status, n in sorted(statuses.items())))
        for seconds, op, status, body in t.slowest[:3]:
            if seconds >= 0.5:
                print(f"   slow: {seconds:.1f} s {op} -> {status}: {show(body)[:300]}")
        if t.errors:
            print("   the 4xx of POST, by param and code: " + ", ".join(
                f"{op.split()[1]} {param}/{code}: {count}"
                for (op, param, code), count in sorted(t.errors.items(), key=str)))
    print(f"== {total} schemathesis cases in all; {len(FINDINGS)} distinct failures; "
          f"server logs: {' '.join(LOGS)}")
    for finding in FINDINGS.values():
        print("!! " + finding.describe())


# -- checks ------------------------------------------------------------------------------------
def error_shape_problem(payload: object) -> str | None:
    """Why ``payload`` is not OpenAI's error body, or None when it is."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return f"not {{'error': {{...}}}}: {payload!r:.300}"
    info = payload["error"]
    if not isinstance(info, dict) or set(info) != {"message", "type", "param", "code"}:
        return f"error is not {{message, type, param, code}}: {info!r:.300}"
    for key in ("message", "type"):
        if not isinstance(info[key], str) or not info[key]:
            return f"error.{key} is not a non-empty string: {info[key]!r:.100}"
    for key in ("param", "code"):
        if info[key] is not None and not isinstance(info[key], str):
            return f"error.{key} is neither a string nor null: {info[key]!r:.100}"
    return None


def openai_error_shape(ctx, response, case) -> None:
    """Every 4xx body is OpenAI's error object (499, the client having left, has none)."""
    if 400 <= response.status_code < 500 and response.status_code != 499:
        try:
            payload = json.loads(response.content)
        except ValueError:
            raise AssertionError(f"the {response.status_code} body is not JSON: "
                                 f"{response.content[:300]!r}") from None
        problem = error_shape_problem(payload)
        if problem:
            raise AssertionError(f"the {response.status_code} body is {problem}")


INTERNAL_CODES = ("engine_error", "request_failed", "internal_error")


def stream_errors_well_formed(ctx, response, case) -> None:
    """A 200 event stream reports a failure as an error event: in OpenAI's shape, and never an
    internal (500-class) error hidden behind the 200."""
    if response.status_code != 200 or not any(
            "text/event-stream" in v for v in response.headers.get("content-type", [])):
        return
    for line in sse_split(response.content):  # U+0085 or U+2028 inside a JSON string is no break
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[len("data: "):])
        except ValueError:
            if response.stream_cut_short:
                continue  # the last event read may be cut off
            raise AssertionError(f"a stream event is not JSON: {line[:300]!r}") from None
        if isinstance(event, dict) and "error" in event:
            problem = error_shape_problem(event)
            if problem:
                raise AssertionError(f"a stream error event is {problem}")
            if (event["error"]["type"] == "internal_server_error"
                    or event["error"]["code"] in INTERNAL_CODES):
                raise AssertionError(f"an internal error in the stream: {event['error']}")


OPEN_PATHS = ("/health", "/metrics")


def auth_enforced(target: Target):
    def auth_enforced(ctx, response, case) -> None:
        status = response.status_code
        if not target.auth_required:
            if status == 401:
                raise AssertionError("401 although the request carries the key (or none is set)")
            return
        if case.path.startswith("/v1/") and status != 401:
            raise AssertionError(f"{status} without the key (expected 401)")
        if case.path in OPEN_PATHS and case.method.upper() == "GET" and status != 200:
            raise AssertionError(f"GET {case.path} should stay open without the key, got {status}")
    return auth_enforced


# -- keeping generation cheap ------------------------------------------------------------------
def cap_generation(body: object) -> None:
    """Lower what an accepted body would cost to generate, without changing whether it is
    valid: only integers already in range are lowered (max_tokens past max_model_len still get
    their 400, n past 128 its 400, a min_tokens over max_tokens stays over it), and an absent
    max_tokens stays absent (MAX_MODEL_LEN bounds it)."""
    if not isinstance(body, dict):
        return

    def whole(value: object) -> bool:  # what pydantic takes as an int: 5 and 5.0, not True
        return type(value) is int or (type(value) is float and value.is_integer())

    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if whole(value) and TOKEN_CAP < value <= MAX_MODEL_LEN:
            if whole(body.get("min_tokens")) and body["min_tokens"] > TOKEN_CAP:
                body["min_tokens"] = TOKEN_CAP + (body["min_tokens"] > value)
            body[key] = TOKEN_CAP
    n = body.get("n")
    if whole(n) and N_CAP < n <= 128:
        body["n"] = N_CAP


def _record(target: Target, case, status: int | None, response_text: str, headers: dict,
            problem: str, log_before: int, log: str | None = None) -> None:
    if log is None:
        time.sleep(0.3)  # let the server write its traceback
        log = target.server.log_since(log_before)
    finding = Finding(target.name, case.method.upper(), case.formatted_path, case.query,
                      case.body, headers, status, response_text, problem, log)
    FINDINGS[finding.key()] = finding  # the last one (shrunk furthest) of each kind


def _fuzz_case(target: Target):
    checks = [not_a_server_error, openai_error_shape, stream_errors_well_formed,
              auth_enforced(target)]

    def test(case) -> None:
        cap_generation(case.body)
        server = target.server
        log_before = server.log_size()
        try:
            response = case.call(base_url=server.base_url, headers=target.headers,
                                 timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            time.sleep(1.0)
            log = server.log_since(log_before)
            died = server.dead()
            _record(target, case, None, f"{type(exc).__name__}: {exc}", target.headers or {},
                    "the server died" if died else "no answer", log_before, log)
            if died:
                server.restart()
            raise AssertionError(f"no answer from the server: {exc}") from None
        op = f"{case.method.upper()} {case.path}"
        target.cases[(op, response.status_code)] += 1
        target.slowest = sorted([*target.slowest, (response.elapsed, op, response.status_code,
                                                   case.body)], key=lambda x: -x[0])[:5]
        if 400 <= response.status_code < 500 and case.method.upper() == "POST":
            try:
                error = json.loads(response.content)["error"]
                target.errors[(op, error["param"], error["code"])] += 1
            except (ValueError, KeyError, TypeError):
                pass
        try:
            case.validate_response(response, checks=checks, headers=target.headers)
            if "Traceback (most recent call last)" in server.log_since(log_before):
                raise AssertionError(f"the server logged a traceback (answering "
                                     f"{response.status_code})")
        except BaseException as exc:
            _record(target, case, response.status_code,
                    response.content.decode("utf-8", "replace"), dict(response.request.headers),
                    str(exc), log_before)
            raise

    return test


VOCAB_SIZE = 49152  # SmolLM2's
CHAT_ROLES = ["system", "user", "assistant", "tool"]


def _tighten(prop: dict | None, **by_type: dict) -> None:
    """Add constraints to the branches of a property schema, by JSON type."""
    for branch in (prop or {}).get("anyOf", [prop or {}]):
        branch.update(by_type.get(branch.get("type"), {}))


def refine_schema(raw: dict, model_name: str) -> dict:
    """What the server checks beyond its OpenAPI schema (served model names, chat roles, no
    empty stop string, prompt plus max_tokens within max_model_len, token ids in the vocab),
    added to the schema the cases are generated from: positive cases then get past the
    semantic checks to the engine, and negative ones break exactly those rules."""
    schemas = raw.get("components", {}).get("schemas", {})
    token = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        _tighten(props.get("model"), string={"enum": [model_name]})
        _tighten(props.get("stop"), string={"minLength": 1, "maxLength": 20},
                 array={"maxItems": 4, "items": {"type": "string", "minLength": 1,
                                                 "maxLength": 20}})
        # (not bounded by the vocabulary: the server does not check that)
        _tighten(props.get("stop_token_ids"), array={"maxItems": 4, "items": {
            "type": "integer", "minimum": 0}})
        for key in ("max_tokens", "max_completion_tokens"):
            _tighten(props.get(key), integer={"maximum": MAX_MODEL_LEN // 2})
        _tighten(props.get("min_tokens"), integer={"maximum": TOKEN_CAP})
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for branch in prompt.get("anyOf", []):
        if branch.get("type") == "string":
            branch.update(minLength=1, maxLength=40)
        elif branch.get("type") == "array":
            branch.update(minItems=1, maxItems=3 if branch["items"].get("type") != "integer"
                          else 40)
            items = branch["items"]
            if items.get("type") == "string":
                items.update(minLength=1, maxLength=40)
            elif items.get("type") == "integer":
                items.update(token)
            elif items.get("type") == "array":
                items.update(minItems=1, maxItems=40, items=token)
    chat = schemas.get("ChatCompletionRequest", {}).get("properties", {})
    _tighten(chat.get("messages"), array={"minItems": 1, "maxItems": 4})
    message = schemas.get("ChatMessage", {}).get("properties", {})
    _tighten(message.get("role"), string={"enum": CHAT_ROLES})
    _tighten(message.get("content"), string={"maxLength": 60}, array={"maxItems": 3})
    _tighten(schemas.get("TextContentPart", {}).get("properties", {}).get("text"),
             string={"maxLength": 40})
    responses = schemas.get("ResponsesRequest", {}).get("properties", {})
    _tighten(responses.get("model"), string={"enum": [model_name]})
    _tighten(responses.get("max_output_tokens"), integer={"maximum": MAX_MODEL_LEN // 2})
    _tighten(responses.get("input"), string={"maxLength": 40}, array={"maxItems": 3})
    _tighten(responses.get("instructions"), string={"maxLength": 40})
    short = {"string": {"maxLength": 40}, "array": {"maxItems": 3}}
    for name, key in (("InputMessage", "content"), ("InputText", "text"),
                      ("FunctionCallInput", "arguments"), ("FunctionCallOutputInput", "output")):
        _tighten(schemas.get(name, {}).get("properties", {}).get(key), **short)
    return raw


def _config(phases: tuple[str, ...], seed: int) -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        "seed": seed,
        "generation": {"mode": "all", "database": "none"},
        "phases": {name: {"enabled": name in phases}
                   for name in ("examples", "coverage", "fuzzing", "stateful")},
    })


HYPOTHESIS_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                               suppress_health_check=list(HealthCheck), print_blob=True)


def _run(target: Target) -> None:
    start = time.monotonic()
    TARGETS.append(target)
    target.seed = SEED + len(TARGETS) - 1  # each run its own cases
    log_start, restarts = target.server.log_size(), target.server.restarts
    raw = httpx.get(f"{target.server.base_url}/openapi.json", headers=target.schema_headers,
                    timeout=30).json()
    model_name = httpx.get(f"{target.server.base_url}/v1/models", headers=target.schema_headers,
                           timeout=30).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(refine_schema(json.loads(json.dumps(raw)), model_name),
                                            config=_config(target.phases, target.seed))
    failures = {}
    tested = set()
    for result in get_all_tests(schema=schema, test_func=_fuzz_case(target),
                                settings=HYPOTHESIS_SETTINGS, given_kwargs={}):
        operation, test = result.ok()  # an invalid schema operation raises here
        tested.add((operation.method.upper(), operation.path))
        try:
            test()
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup is a Base...
            failures[operation.label] = exc  # every operation runs; reported together below
    target.seconds = time.monotonic() - start
    # Tracebacks written after their case was checked (a stream's tail, a disconnect)
    log = target.server.log_since(log_start if target.server.restarts == restarts else 0)
    if "Traceback (most recent call last)" in log:
        failures["server log"] = AssertionError(
            "the server logged tracebacks:\n" + "\n".join(
                chunk[-3000:] for chunk in log.split("Traceback (most recent call last)")[1:4]))
    documented = {(m.upper(), p) for p, ops in raw["paths"].items() for m in ops}
    assert tested == documented, "schemathesis skipped operations"
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health",
            "/metrics"} <= set(raw["paths"])
    assert not failures, "\n\n".join(f"== {label}:\n{exc}" for label, exc in failures.items())


def test_fuzz_open_server(open_server):
    _run(Target("open", open_server, None, {}, auth_required=False,
                phases=("examples", "coverage", "fuzzing")))


# The open run covers what the body does; with the key, the point is the key's handling.
@pytest.mark.parametrize("with_key", [True, False], ids=["key+header", "key-no-header"])
def test_fuzz_keyed_server(keyed_server, with_key):
    key_header = {"Authorization": f"Bearer {API_KEY}"}
    _run(Target("key+header" if with_key else "key-no-header", keyed_server,
                key_header if with_key else None, key_header, auth_required=not with_key,
                phases=("fuzzing",) if with_key else ("coverage", "fuzzing")))


def test_keyed_server_plain_requests(keyed_server):
    """The key's rules by hand: schemathesis checks them per case, this names them."""
    url = keyed_server.base_url
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"X-Api-Key": API_KEY}):
        for method, path, kwargs in (("GET", "/v1/models", {}),
                                     ("POST", "/v1/completions", {"json": body}),
                                     ("POST", "/v1/completions", {"content": b"{not json"}),
                                     ("POST", "/v1/chat/completions", {"json": {}})):
            r = httpx.request(method, url + path, headers=headers, timeout=30, **kwargs)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert error_shape_problem(r.json()) is None, r.text
    for path in OPEN_PATHS:
        assert httpx.get(url + path, timeout=30).status_code == 200
    good = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url + "/v1/completions", json=body, headers=good, timeout=60)
    assert r.status_code == 200, r.text


# -- what /openapi.json does not list ----------------------------------------------------------
OFF_SCHEMA = [
    ("GET", "/nope", {}), ("GET", "/v1/nope", {}), ("POST", "/v1/completions/", {}),
    ("GET", "/dashboard/static/nope.js", {}), ("GET", "/dashboard/static/../../../etc/passwd", {}),
    ("GET", "/dashboard/static/%2e%2e/%2e%2e/app.py", {}), ("HEAD", "/health", {}),
    ("GET", "/docs", {}), ("GET", "/redoc", {}), ("GET", "/openapi.json", {}),
    ("POST", "/v1/completions", {"content": b'{"prompt": "Hi"}',
                                 "headers": {"Content-Type": "text/plain"}}),
    ("POST", "/v1/completions", {"content": b'prompt=Hi',
                                 "headers": {"Content-Type": "application/x-www-form-urlencoded"}}),
    ("POST", "/v1/completions", {"content": b'{"prompt": "Hi", "max_tokens": 2}',
                                 "headers": {"Content-Type": "application/json; charset=latin-1"}}),
    ("POST", "/v1/completions", {"content": b'{"prompt": "Hi", "max_tokens": 2}',
                                 "headers": {"Content-Encoding": "gzip",
                                             "Content-Type": "application/json"}}),
    ("GET", "/v1/engine/steps?since=-1", {}), ("GET", "/v1/engine/steps?since=1e400", {}),
    ("GET", "/v1/engine/steps?since=99999999999999999999999", {}),
    ("GET", "/v1/engine/dashboard?window=nan", {}), ("GET", "/v1/engine/dashboard?window=inf", {}),
    ("GET", "/v1/engine/dashboard?since_step=99999999999999999999999", {}),
]


@pytest.mark.parametrize("method,path,kwargs", OFF_SCHEMA,
                         ids=[f"{m} {p} {' '.join(k.get('headers', {}).values())}".strip()
                              for m, p, k in OFF_SCHEMA])
def test_off_schema_requests(open_server, method, path, kwargs):
    log_before = open_server.log_size()
    r = httpx.request(method, open_server.base_url + path, timeout=60, **kwargs)
    time.sleep(0.2)
    log = open_server.log_since(log_before)
    detail = f"{method} {path} {kwargs} -> {r.status_code} {r.text[:500]}"
    assert r.status_code < 500 and "Traceback (most recent call last)" not in log, (
        f"{detail}\nserver log:\n{log[-4000:]}")
    if r.status_code >= 400 and method != "HEAD":
        assert error_shape_problem(r.json()) is None, detail


# -- bodies that JSON schema cannot express, over HTTP ------------------------------------------
CHAT = '"messages": [{"role": "user", "content": "Hi"}]'
RAW_BODIES = {
    "nan temperature": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": NaN}'),
    "infinite temperature": ("/v1/completions",
                             '{"prompt": "Hi", "max_tokens": 2, "temperature": Infinity}'),
    "infinite repetition_penalty": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                                    '"repetition_penalty": Infinity}'),
    "nan top_p": ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": 2, "top_p": NaN}'),
    "-infinity presence_penalty": ("/v1/chat/completions",
                                   '{' + CHAT + ', "max_tokens": 2, "presence_penalty": -Infinity}'),
    "infinite timeout": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                         '"timeout": Infinity}'),
    "lone surrogate prompt": ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "lone surrogate message": ("/v1/chat/completions",
                               '{"messages": [{"role": "user", "content": "\\udfff"}], '
                               '"max_tokens": 2}'),
    "lone surrogate stop": ("/v1/completions",
                            '{"prompt": "Hi", "max_tokens": 2, "stop": "\\ud83d"}'),
    "lone surrogate model": ("/v1/completions",
                             '{"prompt": "Hi", "max_tokens": 2, "model": "\\ud800"}'),
    "lone surrogate key": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "\\ud800": 1}'),
    "NUL in prompt": ("/v1/completions", '{"prompt": "a\\u0000b", "max_tokens": 2}'),
    "deep nesting": ("/v1/completions", '{"prompt": ' + "[" * 50000 + "]" * 50000 + "}"),
    "huge integer": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1' + "0" * 5000 + "}"),
    "huge seed": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": 1, '
                  '"seed": 100000000000000000000000}'),
    "negative seed": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": 1, '
                      '"seed": -1}'),
    "huge top_k": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": 1, '
                   '"top_k": 100000000000000000000000, "top_p": 0.9}'),
    "top_k 2**63": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": 1, '
                    '"top_k": 9223372036854775808}'),
    "seed 2**64-1": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": 1, '
                     '"seed": 18446744073709551615}'),
    "seed -2**63-1": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "temperature": 1, '
                      '"seed": -9223372036854775809}'),
    "huge priority": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                      '"priority": 100000000000000000000000}'),
    "huge stop_token_ids": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                            '"min_tokens": 1, "stop_token_ids": [100000000000000000000000]}'),
    "out-of-vocab stop_token_ids": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                                    '"min_tokens": 1, "stop_token_ids": [49152]}'),
    "out-of-vocab stop_token_ids, no min_tokens": ("/v1/completions", '{"prompt": "Hi", '
                                                   '"max_tokens": 2, "stop_token_ids": [49152]}'),
    "huge prompt token id": ("/v1/completions",
                             '{"prompt": [100000000000000000000000], "max_tokens": 2}'),
    "bool as n": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "n": true}'),
    "float max_tokens": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2.0}'),
    "tiny temperature": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                         '"temperature": 1e-300}'),
    "just above greedy": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                          '"temperature": 0.00002}'),
    "tiny top_p": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "top_p": 1e-300}'),
    "tiny repetition_penalty": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, '
                                '"repetition_penalty": 1e-300}'),
    "tiny timeout": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "timeout": 1e-300}'),
    "logprobs 20 with n": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "logprobs": 20, '
                           '"n": 2, "stream": true}'),
    "top_logprobs 20": ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": 2, '
                        '"logprobs": true, "top_logprobs": 20, "stream": true}'),
    "nan temperature, responses": ("/v1/responses", '{"input": "Hi", "max_output_tokens": 2, '
                                   '"temperature": NaN}'),
    "lone surrogate input": ("/v1/responses", '{"input": [{"role": "user", "content": '
                             '[{"type": "input_text", "text": "\\ud800"}]}], '
                             '"max_output_tokens": 2, "stream": true}'),
    "empty input": ("/v1/responses", '{"input": [], "max_output_tokens": 2}'),
    "empty content parts": ("/v1/chat/completions",
                            '{"messages": [{"role": "user", "content": []}], "max_tokens": 2}'),
    "null content": ("/v1/chat/completions",
                     '{"messages": [{"role": "assistant", "content": null}], "max_tokens": 2}'),
    "no generation prompt": ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": 2, '
                             '"add_generation_prompt": false}'),
    "body is a list": ("/v1/completions", '[{"prompt": "Hi"}]'),
    "body is a string": ("/v1/completions", '"Hi"'),
    "body is null": ("/v1/completions", 'null'),
    "empty body": ("/v1/completions", ''),
    "not UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
    "BOM": ("/v1/completions", '\ufeff{"prompt": "Hi", "max_tokens": 2}'),
    "17 MiB body": ("/v1/completions", '{"prompt": "' + "x" * (17 * 2**20) + '"}'),
}


@pytest.mark.parametrize("name", list(RAW_BODIES))
def test_raw_bodies(open_server, name):
    path, body = RAW_BODIES[name]
    content = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
    log_before = open_server.log_size()
    try:
        r = httpx.post(open_server.base_url + path, content=content, timeout=REQUEST_TIMEOUT_S,
                       headers={"Content-Type": "application/json"})
    except httpx.TransportError as exc:
        time.sleep(1.0)
        log = open_server.log_since(log_before)
        if open_server.dead():
            open_server.restart()
        pytest.fail(f"{name}: no answer ({exc}); server log:\n{log[-4000:]}")
    detail = f"{name}: POST {path} {content[:300]!r} -> {r.status_code} {r.text[:1000]}"
    time.sleep(0.2)
    log = open_server.log_since(log_before)
    if r.status_code >= 500 or "Traceback (most recent call last)" in log:
        pytest.fail(f"{detail}\nserver log:\n{log[-4000:]}")
    if r.status_code >= 400:
        problem = error_shape_problem(r.json())
        assert problem is None, f"{detail}: {problem}"
    elif "text/event-stream" in r.headers.get("content-type", ""):
        for line in sse_split(r.content):
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event or (
                    event["error"].get("code") not in INTERNAL_CODES), detail
    else:
        assert r.json().get("choices" if "responses" not in path else "output") is not None, detail


# -- the request models, in-process --------------------------------------------------------------
# Text with everything JSON can carry: lone surrogates, NUL, every plane.
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
HUGE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 10**30, 10**400,
                             -10**400])
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SCALARS = (st.none() | st.booleans() | st.integers() | HUGE_INTS | FLOATS | TEXT
           | st.sampled_from(["", "1", "true", "null", "NaN", "1e999", "\x00"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)


def nested(depth: int) -> object:
    value: object = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


# (deeper still in EXTREMES below: hypothesis could not print a failing example that deep)
JUNK = JSON | st.integers(min_value=1, max_value=800).map(nested)


def mostly(valid: st.SearchStrategy, junk_in: int = 10) -> st.SearchStrategy:
    """``valid`` (values of the right type, in and just out of range), or junk one time in
    ``junk_in``."""
    # (hypothesis favours the ends of a range: a middle draw is about 1 in junk_in)
    return st.integers(0, junk_in - 1).flatmap(lambda i: JUNK if i == junk_in // 2 else valid)


def ints(lo: int, hi: int) -> st.SearchStrategy:
    return st.integers(lo, hi) | st.sampled_from([lo - 1, lo, hi, hi + 1]) | HUGE_INTS


def floats(lo: float, hi: float) -> st.SearchStrategy:
    return (st.floats(lo, hi) | st.sampled_from([lo, hi, lo - 1e-9, hi + 1e-9, 5e-324, -0.0])
            | FLOATS | st.integers(int(lo) - 1, int(hi) + 1))


TOKEN_IDS = st.lists(mostly(ints(0, 49151)), max_size=6)
SAMPLING_FIELDS = {
    "model": mostly(st.none() | st.just("SmolLM2-135M-Instruct.Q4_1") | TEXT),
    "n": mostly(ints(1, 128)),
    "temperature": mostly(floats(0, 2)),
    "top_p": mostly(floats(0, 1)),
    "stop": mostly(st.none() | TEXT | st.lists(TEXT, max_size=20)
                   | st.text(max_size=1100).map(lambda t: t * 2)),
    "seed": mostly(st.none() | st.integers() | HUGE_INTS),
    "presence_penalty": mostly(floats(-2, 2)),
    "frequency_penalty": mostly(floats(-2, 2)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.none() | st.fixed_dictionaries(
        {}, optional={"include_usage": mostly(st.booleans())})),
    "user": mostly(st.none() | TEXT),
    "top_k": mostly(ints(-1, 50000)),
    "min_p": mostly(floats(0, 1)),
    "repetition_penalty": mostly(floats(0, 2)),
    "min_tokens": mostly(ints(0, 64)),
    "ignore_eos": mostly(st.booleans()),
    "stop_token_ids": mostly(st.none() | TOKEN_IDS | st.lists(st.integers(), max_size=20)),
    "priority": mostly(st.integers() | HUGE_INTS),
    "timeout": mostly(st.none() | floats(0, 600)),
}
CONTENT_PART = mostly(st.fixed_dictionaries({"text": mostly(TEXT)},
                                            optional={"type": mostly(st.just("text") | TEXT)}))
MESSAGE = mostly(st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "assistant", "system", "tool", ""]) | TEXT)},
    optional={"content": mostly(st.none() | TEXT | st.lists(CONTENT_PART, max_size=3)),
              "name": mostly(st.none() | TEXT)}))


def body_of(required: dict, optional: dict) -> st.SearchStrategy:
    """A JSON object: the required fields (each left out one time in eight), some optional
    ones, and a few unknown keys; or one time in ten, junk instead of an object."""
    present = st.fixed_dictionaries({k: mostly(v, 8) for k, v in required.items()}).flatmap(
        lambda d: st.integers(0, 7).map(lambda i: {} if i == 4 else d))
    fields = st.fixed_dictionaries({}, optional=optional)
    extra = st.dictionaries(TEXT, JUNK, max_size=2)
    obj = st.tuples(extra, fields, present).map(lambda parts: {k: v for p in parts
                                                              for k, v in p.items()})
    return mostly(obj, 10)


COMPLETION_BODIES = body_of(
    {"prompt": TEXT | st.lists(TEXT, max_size=300) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3)},
    {**SAMPLING_FIELDS,
     "max_tokens": mostly(ints(1, 2048)),
     "logprobs": mostly(st.none() | ints(0, 20)),
     "echo": mostly(st.booleans())})
CHAT_BODIES = body_of(
    {"messages": st.lists(MESSAGE, max_size=4)},
    {**SAMPLING_FIELDS,
     "max_tokens": mostly(st.none() | ints(1, 2048)),
     "max_completion_tokens": mostly(st.none() | ints(1, 2048)),
     "logprobs": mostly(st.booleans()),
     "top_logprobs": mostly(st.none() | ints(0, 20)),
     "add_generation_prompt": mostly(st.booleans())})


RESPONSE_ITEM = mostly(
    st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "developer"])),
                           "content": mostly(TEXT | st.lists(st.fixed_dictionaries({
                               "type": mostly(st.sampled_from(["input_text", "output_text"])),
                               "text": mostly(TEXT)}), max_size=2))},
                          optional={"type": mostly(st.just("message"))})
    | st.fixed_dictionaries({"type": st.just("function_call"), "call_id": mostly(TEXT),
                             "name": mostly(TEXT), "arguments": mostly(TEXT)})
    | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": mostly(TEXT),
                             "output": mostly(TEXT)}))
RESPONSES_BODIES = body_of(
    {"input": TEXT | st.lists(RESPONSE_ITEM, max_size=4)},
    {key: SAMPLING_FIELDS[key] for key in ("model", "temperature", "top_p", "stream", "user")}
    | {"max_output_tokens": mostly(st.none() | ints(1, 2048)),
       "instructions": mostly(st.none() | TEXT),
       "store": mostly(st.none() | st.booleans()),
       "previous_response_id": mostly(st.none() | TEXT),
       "background": mostly(st.none() | st.booleans()),
       "tool_choice": mostly(st.sampled_from(["none", "auto", "required"])
                             | st.fixed_dictionaries({"type": st.just("function"),
                                                      "name": mostly(TEXT)})),
       "text": mostly(st.fixed_dictionaries({"format": mostly(st.fixed_dictionaries(
           {"type": mostly(st.sampled_from(["text", "json_object", "json_schema"]))},
           optional={"name": mostly(TEXT), "schema": mostly(JSON)}))}))})


def parse_like_fastapi(model: type, body: object) -> None:
    """Validate as FastAPI does a JSON body (loc prefixed with "body"), and translate the
    failure as the server's handler does; a failure must come out a 400 in OpenAI's shape."""
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        api_error = _validation_error(RequestValidationError(errors, body=body))
        assert isinstance(api_error, APIError)
        assert api_error.status == 400
        response = api_error.response()  # renders the JSON body: must not raise either
        assert response.status_code == 400
        payload = json.loads(response.body)
        assert error_shape_problem(payload) is None, payload
        # (a field the server refuses as not implemented is not one of the model's)
        assert payload["error"]["param"] is None or payload["error"]["param"] in (
            *model.model_fields, *NOT_IMPLEMENTED, *RESPONSES_NOT_IMPLEMENTED), payload
        return
    if isinstance(request, ResponsesRequest):
        try:
            request = to_chat(request)
        except APIError as e:
            assert e.status == 400 and error_shape_problem(json.loads(e.response().body)) is None
            return
    # What the handlers do next without a model: SamplingParams may refuse (a ValueError, which
    # ServerState.sampling_params turns into a 400), nothing else.
    if isinstance(request, CompletionRequest):
        max_tokens, logprobs = request.max_tokens, request.logprobs
    else:
        max_tokens = request.max_completion_tokens or request.max_tokens or 16
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    try:
        request.sampling_params(max_tokens, logprobs)
    except ValueError:
        pass


PARSER_SETTINGS = settings(max_examples=int(os.environ.get("CONVEYOR_FUZZ_PARSER_EXAMPLES", "400")),
                           deadline=None, database=None,
                           suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])


@PARSER_SETTINGS
@given(COMPLETION_BODIES)
def test_completion_request_parser(body):
    parse_like_fastapi(CompletionRequest, body)


@PARSER_SETTINGS
@given(CHAT_BODIES)
def test_chat_request_parser(body):
    parse_like_fastapi(ChatCompletionRequest, body)


@PARSER_SETTINGS
@given(RESPONSES_BODIES)
def test_responses_request_parser(body):
    parse_like_fastapi(ResponsesRequest, body)


EXTREMES = {
    "nested": nested(5000), "nested prompt": {"prompt": nested(5000)},
    "nested messages": {"messages": nested(5000)},
    "surrogates, 17 stops": {"prompt": "\ud800", "stop": ["\udfff"] * 17},
    "10000 prompts": {"prompt": ["x"] * 10000},
    "5000 messages": {"messages": [{"role": "user", "content": "x"}] * 5000},
    "5000-digit max_tokens": {"prompt": "x", "max_tokens": 10**5000},
    "surrogate key": {"\ud800": 1, "prompt": 1},
}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest,
                                   ResponsesRequest])
@pytest.mark.parametrize("name", list(EXTREMES))
def test_request_parser_extremes(model, name):
    parse_like_fastapi(model, EXTREMES[name])


# -- the same bodies through FastAPI, in-process -------------------------------------------------
@pytest.fixture(scope="module")
def parser_client():
    """The server's error handlers on a minimal app whose routes take the real request models
    and only echo them: FastAPI's own JSON decoding and validation, no model."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from conveyor.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict:
        return {"ok": body.model_dump(mode="json") is not None}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"ok": body.model_dump(mode="json") is not None}

    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def post_like_a_client(client, path: str, body: object) -> None:
    content = show(body).encode()  # NaN and Infinity as Python's json writes them
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400), (path, content[:500], r.status_code, r.text[:500])
    if r.status_code == 400:
        assert error_shape_problem(r.json()) is None, (path, content[:500], r.text[:500])


TESTCLIENT_SETTINGS = settings(PARSER_SETTINGS, max_examples=max(
    1, PARSER_SETTINGS.max_examples // 2))


@TESTCLIENT_SETTINGS
@given(COMPLETION_BODIES)
def test_completion_bodies_through_fastapi(parser_client, body):
    post_like_a_client(parser_client, "/v1/completions", body)


@TESTCLIENT_SETTINGS
@given(CHAT_BODIES)
def test_chat_bodies_through_fastapi(parser_client, body):
    post_like_a_client(parser_client, "/v1/chat/completions", body)
