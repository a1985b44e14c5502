"""`make compose-test`: the image built and `docker compose up` served, end to end, as a user runs it.

Steps (each prints one line; any failure stops, tears everything down and exits 1):
 1. base images: pulled, or stand-ins built from Debian's packages (tools/compose/standins.sh);
 2. the image (`docker build`), with torch's CPU build from TORCH_INDEX: PyTorch's CPU index where it
    answers, else a one-wheel index on this machine's loopback holding what pip here resolves for the
    pinned torch (the build then runs on the host's network to reach it);
 3. its size, against the 2.5 GB bound;
 4. `docker compose up` in a project of its own, with a random Redis password and a free port;
 5. every model id of /v1/models through the openai client, streamed and not; the time from `up` to the
    first answer, against the 120 s bound;
 6. the worker crashes (its main process SIGKILLed from the host): compose's restart policy brings it
    back, and later requests are served. (`docker kill` is a stop the operator asked for: Docker's
    restart policies leave such a container down, so it cannot stand for a crash.)
 7. `redis-cli` inside the redis container reads the request stream;
 8. everything torn down (containers, network, volumes).
The figures go to stdout and, with --json FILE, to a file."""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "mfs-compose-test"
IMAGE_BOUND = 2.5e9
FIRST_ANSWER_BOUND_S = 120.0
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def say(msg: str) -> None:
    print(f"compose-test: {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    kw.setdefault("text", True)
    return subprocess.run(cmd, **kw)


def compose_cmd() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    raise SystemExit("compose-test: neither docker-compose nor `docker compose` is here")


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=15)
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_torch_index(folder: Path) -> tuple[str, http.server.ThreadingHTTPServer, str]:
    """A one-wheel package index on the loopback: the pinned torch as pip here resolves it."""
    pin = next(ln.strip() for ln in (ROOT / "requirements.lock").read_text().splitlines() if ln.startswith("torch=="))
    (folder / "torch").mkdir(parents=True)
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--python-version",
         "3.11", "-d", str(folder / "torch"), pin], capture_output=True)
    (wheel,) = [p.name for p in (folder / "torch").glob("*.whl")]
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass
    handler = functools.partial(Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server, wheel


def build_image(index: str, network_host: bool) -> float:
    cmd = ["docker", "build", "-q", "-t", "mfs:latest", "--build-arg", f"TORCH_INDEX={index}", str(ROOT)]
    if network_host:
        cmd[2:2] = ["--network", "host"]
    t0 = time.monotonic()
    res = run(cmd, capture_output=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"docker build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return time.monotonic() - t0


def wait_for(what: str, check, timeout_s: float, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
        except Exception as e:  # noqa: BLE001 - a service still starting answers with anything
            last = e
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (last error: {last})")


def ask_every_model(client) -> dict[str, dict]:
    out = {}
    ids = [m.id for m in client.models.list().data]
    assert ids, "/v1/models lists no model"
    for mid in ids:
        msg = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
        plain = client.chat.completions.create(model=mid, messages=msg, max_tokens=16, temperature=0)
        text = plain.choices[0].message.content or ""
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=mid, messages=msg, max_tokens=16, temperature=0, stream=True) if c.choices]
        assert text.strip() and "".join(parts).strip(), f"{mid}: an empty answer ({text!r}, {parts!r})"
        out[mid] = {"answer": text, "streamed": "".join(parts)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--skip-build", action="store_true", help="use the mfs:latest image already here")
    args = ap.parse_args(argv)
    import openai  # noqa: PLC0415 - the suite's package (requirements-dev.lock)

    compose = compose_cmd()
    run(["docker", "info"], capture_output=True)
    figures: dict = {"cpu": platform.processor() or _cpu_name(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="mfs-compose-") as tmp:
        server = None
        env_file = Path(tmp) / "compose.env"
        port = free_port()
        env_file.write_text(f"MFS_REDIS_PASSWORD={secrets.token_hex(16)}\nMFS_PORT={port}\n")
        base = [*compose, "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), "--env-file", str(env_file)]
        try:
            say("1/8 base images")
            run(["bash", str(ROOT / "tools/compose/standins.sh")])
            if not args.skip_build:
                index = os.environ.get("TORCH_INDEX", CPU_INDEX)
                local = False
                if index and not reachable(index):
                    index, server, wheel = local_torch_index(Path(tmp) / "index")
                    local = True
                    say(f"2/8 PyTorch's CPU index cannot be reached: torch from {index} ({wheel})")
                say(f"2/8 docker build (TORCH_INDEX={index})")
                figures["build_s"] = round(build_image(index, network_host=local), 1)
                say(f"2/8 built in {figures['build_s']} s")
            size = int(run(["docker", "image", "inspect", "mfs:latest", "--format", "{{.Size}}"],
                           capture_output=True).stdout)
            figures["image_bytes"] = size
            say(f"3/8 image mfs:latest: {size / 1e9:.2f} GB (bound {IMAGE_BOUND / 1e9} GB)")
            assert size <= IMAGE_BOUND, f"the image is {size / 1e9:.2f} GB, over {IMAGE_BOUND / 1e9} GB"

            say("4/8 docker compose up")
            t_up = time.monotonic()
            run([*base, "up", "-d"], capture_output=True)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
            msg = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
            first = wait_for("a first answer", lambda: client.chat.completions.create(
                model="smollm2-135m-large", messages=msg, max_tokens=16, temperature=0).choices[0].message.content,
                timeout_s=600, every_s=2)
            figures["first_answer_s"] = round(time.monotonic() - t_up, 1)
            say(f"5/8 first answer {figures['first_answer_s']} s after up (bound {FIRST_ANSWER_BOUND_S:.0f} s): {first!r}")
            figures["answers"] = ask_every_model(client)
            say(f"5/8 every model id answered, streamed and not: {', '.join(figures['answers'])}")

            cid = run([*base, "ps", "-q", "worker"], capture_output=True).stdout.split()[0]
            before = _inspect(cid)
            run(["kill", "-9", str(before["pid"])])
            say(f"6/8 worker container {cid[:12]}: its main process (pid {before['pid']}) killed with SIGKILL")
            wait_for("the worker restarted by compose", lambda: (s := _inspect(cid))["running"]
                     and s["restarts"] > before["restarts"], timeout_s=120)
            again = wait_for("an answer after the restart", lambda: client.chat.completions.create(
                model="smollm2-135m-large", messages=msg, max_tokens=16, temperature=0).choices[0].message.content,
                timeout_s=300, every_s=2)
            figures["after_restart"] = again
            say(f"6/8 restarted (RestartCount {_inspect(cid)['restarts']}) and serving: {again!r}")

            xlen = run([*base, "exec", "-T", "redis", "redis-cli", "XLEN", "mfs:req"], capture_output=True).stdout.strip()
            groups = run([*base, "exec", "-T", "redis", "redis-cli", "XINFO", "GROUPS", "mfs:req"],
                         capture_output=True).stdout
            assert xlen.isdigit() and int(xlen) > 0 and "scheduler" in groups, (xlen, groups)
            noauth = run([*base, "exec", "-T", "-e", "REDISCLI_AUTH=", "redis", "redis-cli", "XLEN", "mfs:req"],
                         capture_output=True, check=False).stdout
            assert "NOAUTH" in noauth, f"redis answered without the password: {noauth!r}"
            figures["redis_xlen_req"] = int(xlen)
            say(f"7/8 redis-cli in the redis container: XLEN mfs:req = {xlen}; without the password: NOAUTH")
        finally:
            say("8/8 docker compose down -v")
            run([*base, "down", "-v", "--remove-orphans"], capture_output=True, check=False)
            if server is not None:
                server.shutdown()
    ok = figures.get("first_answer_s", 1e9) <= FIRST_ANSWER_BOUND_S
    say(("passed" if ok else f"FAILED: the first answer came after {figures['first_answer_s']} s") +
        f": image {figures['image_bytes'] / 1e9:.2f} GB, first answer {figures['first_answer_s']} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if ok else 1


def _inspect(cid: str) -> dict:
    out = json.loads(run(["docker", "inspect", cid], capture_output=True).stdout)[0]
    return {"pid": out["State"]["Pid"], "running": out["State"]["Running"], "restarts": out["RestartCount"]}


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
