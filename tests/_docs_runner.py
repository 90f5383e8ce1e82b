"""Run one ```python block of the docs as a reader would paste it, in a fresh interpreter (or a fork).

`python _docs_runner.py < job.json` runs one job, {"path", "line", "source", "port"} and optionally
"step_timeout"; tests/test_docs_examples.py runs `python _docs_runner.py --serve` once and sends it a
job per block, each run in a fork (`serve`, and `Forks` on the caller's side; tests/test_asgi_import_graph.py
imports each asgi module through it too). The block is compiled as `python -m asyncio`
compiles its input (top-level `await`, `async with` and `async for` allowed);
a block without any runs synchronously with no event loop, as in a plain
`python` session (so a blocking API is tried where a reader would call it),
one with them runs in `asyncio.run`.

Then every ASGI app the block left behind is exercised as a server would:
lifespan start-up, one request per route and method (path, query, header and
JSON body values made from FastAPI's OpenAPI schema, or from Starlette's path
convertors), lifespan shutdown. Each answer must be below 500, no step may
hang, nothing may be logged at ERROR. Last, the managers and Redis clients the
block made are closed.

The only address the block may reach is the test's redis-server (loopback,
its port): an audit hook refuses every other connection and name lookup, and
the run fails naming it, even if the block swallowed the error.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import builtins
import inspect
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, NoReturn

STEP_TIMEOUT = 15.0     # seconds for one request, a start-up or a shutdown
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
refused: list[str] = []


def guard_network(port: int) -> None:
    def hook(event: str, args: tuple) -> None:
        if event == "socket.connect":
            address = args[1]
            if not (isinstance(address, tuple) and address[0] in LOOPBACK and address[1] == port):
                refused.append(f"connect to {address!r}")
                raise ConnectionRefusedError(f"docs examples reach only the test's Redis; refused {address!r}")
        elif event == "socket.getaddrinfo":
            host = args[0]
            if isinstance(host, bytes):
                host = host.decode()
            if host not in LOOPBACK and host is not None:
                refused.append(f"name lookup of {host!r}")
                raise ConnectionRefusedError(f"docs examples reach only the test's Redis; refused {host!r}")

    sys.addaudithook(hook)


class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {self.format(record)}")


# -- exercising an ASGI app -------------------------------------------------------


def asgi_apps(namespace: dict[str, Any]) -> list[Any]:
    """The app a server would be pointed at: `app` if the block named one, else every Starlette it built."""
    from starlette.applications import Starlette

    if callable(namespace.get("app")):
        return [namespace["app"]]
    return [value for value in namespace.values() if isinstance(value, Starlette)]


def wrapped(app: Any) -> list[Any]:
    """The app and the apps inside its middleware wrappers (`.app`), outermost first."""
    chain = [app]
    while getattr(chain[-1], "app", None) is not None and len(chain) < 20:
        chain.append(chain[-1].app)
    return chain


def starlette_of(app: Any) -> Any:
    """The Starlette app inside middleware wrappers (instrument_app returns one), or None."""
    from starlette.applications import Starlette

    return next((inner for inner in wrapped(app) if isinstance(inner, Starlette)), None)


def requests_for_rules(app: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """For an app of another framework (Litestar, Quart) behind LockMiddleware: one request per rule.

    Path parameters are "1", the body `{}` as JSON: the answer may be the framework's 4xx, never a 5xx.
    """
    from otel_lock import LockMiddleware

    middleware = next((inner for inner in wrapped(app) if isinstance(inner, LockMiddleware)), None)
    if middleware is None or not middleware.rules:
        raise AssertionError("the block's `app` wraps no Starlette or FastAPI app and no LockMiddleware with "
                             "rules: nothing to send requests to")
    found = []
    for rule in middleware.rules:
        path = re.sub(r"\{[^}]*\}", "1", rule.path_format)
        for method in sorted((rule.methods or {"POST"}) - {"HEAD"}):
            found.append((method, path, {"headers": {"idempotency-key": '"docs-example-1"'}, "json": {}}))
    return found


def sample(schema: dict[str, Any], components: dict[str, Any]) -> Any:
    """A small value the JSON schema accepts."""
    if "$ref" in schema:
        return sample(components[schema["$ref"].rsplit("/", 1)[1]], components)
    for key in ("default", "const", "example"):
        if key in schema:
            return schema[key]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            options = [s for s in schema[key] if s.get("type") != "null"] or schema[key]
            return sample(options[0], components)
    kind = schema.get("type", "object")
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: sample(properties[name], components) for name in schema.get("required", [])}
    if kind == "array":
        return [sample(schema.get("items", {}), components) for _ in range(schema.get("minItems", 0))]
    if schema.get("format") == "uuid":
        return str(uuid.UUID(int=1))
    return {"string": "1", "integer": 1, "number": 1, "boolean": True, "null": None}.get(kind, "1")


def requests_for(app: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx options) for every HTTP route and method of the app."""
    from starlette.routing import Route
    from starlette.convertors import FloatConvertor, IntegerConvertor, UUIDConvertor

    inner = starlette_of(app)
    if inner is None:
        return requests_for_rules(app)
    schema = inner.openapi() if hasattr(inner, "openapi") else {}
    components = schema.get("components", {}).get("schemas", {})
    headers = {"idempotency-key": '"docs-example-1"'}
    found = []
    for route in inner.routes:
        if not isinstance(route, Route):
            continue
        for method in sorted((route.methods or {"GET"}) - {"HEAD"}):
            values = {name: {IntegerConvertor: "1", FloatConvertor: "1.5", UUIDConvertor: str(uuid.UUID(int=1))}
                      .get(type(convertor), "1") for name, convertor in route.param_convertors.items()}
            cookies: dict[str, str] = {}
            options: dict[str, Any] = {"headers": dict(headers), "params": {}}
            operation = schema.get("paths", {}).get(route.path, {}).get(method.lower(), {})
            for parameter in operation.get("parameters", []):
                if parameter.get("required") or parameter["in"] == "path":
                    value = sample(parameter.get("schema", {}), components)
                    target = {"path": values, "query": options["params"], "header": options["headers"],
                              "cookie": cookies}[parameter["in"]]
                    target[parameter["name"]] = str(value)
            if cookies:
                options["headers"]["cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                options["json"] = sample(body.get("schema", {}), components)
            path = route.path_format
            for name, value in values.items():
                path = path.replace("{" + name + "}", value)
            found.append((method, path, options))
    return found


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
    """Start-up and shutdown as a server runs them; yields the lifespan state for the requests."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    state: dict[str, Any] = {}
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": state}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))

    async def answer(to: str) -> None:
        await inbox.put({"type": f"lifespan.{to}"})
        getter = asyncio.ensure_future(outbox.get())
        done, _ = await asyncio.wait({getter, task}, timeout=STEP_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            if task in done:
                task.result()   # the app raised: show it
                raise AssertionError(f"the app returned from its lifespan without answering lifespan.{to}")
            raise AssertionError(f"lifespan.{to} got no answer within {STEP_TIMEOUT} s")
        message = getter.result()
        assert message["type"] == f"lifespan.{to}.complete", f"lifespan.{to} answered {message}"

    try:
        await answer("startup")
        yield state
        await answer("shutdown")
        await asyncio.wait_for(task, STEP_TIMEOUT)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def exercise(app: Any) -> None:
    import httpx

    plan = requests_for(app)
    assert plan, "the app has no HTTP route to send a request to"
    async with lifespan(app) as state:
        async def served(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                scope = {**scope, "state": dict(state)}   # as servers hand lifespan state to requests
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=served)
        async with httpx.AsyncClient(transport=transport, base_url="http://docs.test") as client:
            failures = [failure for method, path, options in plan
                        if (failure := await answered(client, method, path, options))]
    assert not failures, "\n".join(failures)


async def answered(client: Any, method: str, path: str, options: dict[str, Any]) -> str | None:
    """None if the request got an answer below 500 in time, else what went wrong."""
    try:
        response = await asyncio.wait_for(client.request(method, path, **options), STEP_TIMEOUT)
    except TimeoutError:
        return f"{method} {path} got no answer within {STEP_TIMEOUT} s"
    except Exception as exc:   # raised by the app: httpx's ASGITransport passes it on
        traceback.print_exc()
        return f"{method} {path} raised {type(exc).__name__}: {exc}"
    print(f"{method} {path} -> {response.status_code}")
    if response.status_code >= 500:
        return f"{method} {path} answered {response.status_code}: {response.text[:800]}"
    return None


# -- running the block ------------------------------------------------------------


async def close_resources(namespace: dict[str, Any]) -> None:
    """aclose() what the block opened and left open (managers, Redis clients)."""
    seen: set[int] = set()
    for value in list(namespace.values()):
        if isinstance(value, (type, types.ModuleType, types.FunctionType)) or id(value) in seen:
            continue
        seen.add(id(value))
        module = type(value).__module__.split(".")[0]
        if module in ("otel_lock", "redis") and inspect.iscoroutinefunction(getattr(value, "aclose", None)):
            await value.aclose()


async def finish(pending: Any, namespace: dict[str, Any]) -> None:
    try:
        if pending is not None:
            await pending
        for app in asgi_apps(namespace):
            await exercise(app)
    finally:
        await close_resources(namespace)


def main(job: dict[str, Any] | None = None) -> int:
    global STEP_TIMEOUT
    job = json.load(sys.stdin) if job is None else job
    STEP_TIMEOUT = job.get("step_timeout", STEP_TIMEOUT)
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    guard_network(job["port"])
    # Leading newlines: tracebacks name the doc's own line numbers.
    code = compile("\n" * job["line"] + job["source"], job["path"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    # The block is the program's __main__ module, as `python block.py` makes it: frameworks that
    # resolve a handler's annotations in its module (Litestar) find the block's own names there.
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    namespace: dict[str, Any] = module.__dict__
    pending = types.FunctionType(code, namespace)()
    asyncio.run(finish(pending if inspect.iscoroutine(pending) else None, namespace))
    for value in namespace.values():   # blocking managers (otel_lock.sync) close outside any loop
        if type(value).__module__.startswith("otel_lock") and callable(getattr(value, "close", None)) \
                and not isinstance(value, type) and not hasattr(value, "aclose"):
            value.close()
    problems = [f"tried to reach something else than the test's Redis: {what}" for what in refused]
    problems += [f"logged an error: {record}" for record in errors.records]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def serve() -> None:
    """`--serve`: a job per line of stdin, each run by `main` in a fork of this interpreter.

    The fork starts as a fresh interpreter would, but with FastAPI, httpx and redis-py already
    imported (no otel_lock module: the block imports it as a reader's would): about half a second
    a block. Each job is answered with two lines: {"pid"} at once (the caller kills it on a hang),
    then {"status", "stdout", "stderr"} when it has ended.
    """
    import fastapi, httpx, redis.asyncio, starlette.testclient  # noqa: E401, F401 (the forks' head start)

    for line in sys.stdin:
        job = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                run_forked(job, out.fileno(), err.fileno())
            print(json.dumps({"pid": pid}), flush=True)
            _, status = os.waitpid(pid, 0)
            said = []
            for stream in (out, err):
                stream.seek(0)
                said.append(stream.read().decode(errors="replace"))
        print(json.dumps({"status": os.waitstatus_to_exitcode(status), "stdout": said[0], "stderr": said[1]}),
              flush=True)


def run_forked(job: dict[str, Any], out: int, err: int) -> NoReturn:
    """In the fork: `main(job)` with stdin empty and the output in `out` and `err`, ended as an interpreter ends."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 1
    try:
        code = main(job)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter does at exit: wait for the threads the block left running, then atexit.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Forks:
    """The caller's side of `--serve`: started at the first job, each job run in a fork of it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str] = queue.Queue()

    def run(self, job: dict[str, Any], timeout: float) -> tuple[int | None, str]:
        """(exit status, stdout and the end of stderr) of one job; the status is None if it ran past `timeout`."""
        process = self._started()
        assert process.stdin is not None
        process.stdin.write(json.dumps(job) + "\n")
        process.stdin.flush()
        pid = json.loads(self._line(30))["pid"]
        try:
            answer = json.loads(self._line(timeout))
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            answer = json.loads(self._line(30))
            return None, f"no end within {timeout} s:\n{answer['stdout']}{answer['stderr']}"
        return answer["status"], answer["stdout"] + answer["stderr"][-4000:]

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None:
            self._process = subprocess.Popen([sys.executable, "-W", "error", __file__, "--serve"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             cwd=Path(__file__).parent.parent)
            self._reader = threading.Thread(target=self._read, args=(self._process.stdout,), daemon=True)
            self._reader.start()
        return self._process

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put("")  # the runner ended: json.loads fails, naming it

    def _line(self, timeout: float) -> str:
        line = self._lines.get(timeout=timeout)
        assert line, f"the docs runner ended (exit {self._process and self._process.wait()})"
        return line

    def close(self) -> None:
        if self._process is not None:
            assert self._process.stdin is not None and self._process.stdout is not None
            self._process.stdin.close()  # it ends at the end of its stdin, and the reader at the end of its stdout
            self._process.wait(30)
            self._reader.join(30)
            self._process.stdout.close()  # not before: closing it under the reading thread blocks
            self._process = None


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit(main())
