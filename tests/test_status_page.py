"""The gateway's status page (GET /) rendered by headless Chromium while requests run through the whole
service (gateway, scheduler and worker processes, a tiny float64 model over a real tokenizer): its
script fills the tables from /status.json, and two renders a few seconds apart show the numbers moving;
the charts of the last minutes are drawn (in the DOM, and as pixels in a screenshot).

No selenium: ``chromium --headless=new --dump-dom`` prints the DOM after ``--virtual-time-budget``
milliseconds of page time (virtual time waits for pending fetches, so the script's polls complete).
Skipped without chromium (``make test`` installs it with apt-get when it can).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import threading

import httpx2 as httpx
import pytest

from tests.support.factories import tiny_service
from tests.support.wait import wait_for

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install "
                                "chromium; `make test` does it when run as root with apt-get)")


@pytest.fixture(scope="module")
def service(tmp_path_factory, frontend):
    svc = tiny_service(tmp_path_factory.mktemp("tinytok"), frontend.tokenizer)
    svc.gateway_args += ["--history-period", "0.5"]  # chart points every half second
    with svc:
        yield svc


def render(url: str, profile) -> str:
    """The page's DOM after 2.5 s of page time (the script polls every second)."""
    out = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={profile}", "--virtual-time-budget=2500", "--dump-dom", url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def text_of(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert m, f"no #{element_id} in the page"
    return m.group(1)


def cells(dom: str, table_id: str) -> list[list[str]]:
    body = re.search(rf'<table id="{table_id}".*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    return [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def test_status_page_numbers_move_while_requests_run(service, tmp_path):
    stop, done = threading.Event(), []
    family = min((m["id"] for m in httpx.get(service.url + "/v1/models").json()["data"]), key=len)

    def load():  # one client, one request after another, each 24 tokens of the small tier
        with httpx.Client(base_url=service.url, timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": f"{family}-small", "prompt": "Once upon",
                                                    "max_tokens": 24, "ignore_eos": True, "temperature": 0})
                done.append(r.status_code)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        wait_for(lambda: done, 60, "the first answer", poll=0.1)
        assert done == [200] * len(done), done
        first = render(service.url + "/", tmp_path / "profile")
        n = len(done)
        wait_for(lambda: len(done) >= n + 2, 60, "two more answers", poll=0.1)  # the numbers have moved
        second = render(service.url + "/", tmp_path / "profile")
    finally:
        stop.set()
        t.join(60)
    tokens = [float(text_of(d, "tokens-total")) for d in (first, second)]
    requests = [float(text_of(d, "requests-total")) for d in (first, second)]
    assert 0 < tokens[0] < tokens[1] and 0 < requests[0] < requests[1], (tokens, requests)
    assert text_of(second, "state") == "redis up"
    tiers = cells(second, "tiers")
    assert [row[0].split(" ")[0] for row in tiers] == ["small", "medium", "large"]
    # tokens of the small tier; its tok/s is drawn, but virtual time runs the page's polls a few
    # milliseconds apart (the page's second is not the server's), so it may well read 0 here
    assert float(tiers[0][4]) > 0 and float(tiers[0][3]) >= 0
    assert re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+", tiers[0][6])     # TTFT percentiles drawn
    (worker,) = cells(second, "workers")
    assert worker[3].startswith("weights fp32 (--weights fp32); ")    # what it serves, and why
    assert float(worker[4]) < 10                                      # a fresh heartbeat
    (leader,) = cells(second, "schedulers")
    assert leader[1] and float(leader[4]) < 10
    # the charts: tokens/s a line of the small tier; its latencies points (a gap where an interval
    # finished no request: on a busy machine a 24-token request can outlast a half-second interval)
    def drawn(chart: str) -> tuple[int, int]:
        svg = re.search(rf'<svg id="{chart}".*?</svg>', second, re.S).group(0)
        lines = re.findall(r'<polyline points="([^"]*)"[^>]*data-tier="small"', svg)
        dots = re.findall(r'<circle [^>]*data-tier="small"', svg)
        return max((len(pts.split()) for pts in lines), default=0), sum(len(p.split()) for p in lines) + len(dots)

    assert drawn("chart-tok")[0] >= 2 and drawn("chart-req")[0] >= 2, second[-3000:]
    assert drawn("chart-ttft")[1] >= 1 and drawn("chart-tpot")[1] >= 1
    shot = tmp_path / "status.png"
    out = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=2500",
                          "--window-size=1200,900", f"--screenshot={shot}", service.url + "/"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    assert tier_pixels(shot, (0x1F, 0x77, 0xB4)) > 300  # the small tier's lines drawn, not only its legend


def tier_pixels(png, rgb, tol: int = 40) -> int:
    """Pixels of the screenshot within ``tol`` of a tier's colour (the legend's square is ~100)."""
    from PIL import Image
    raw = Image.open(png).convert("RGB").tobytes()
    return sum(1 for i in range(0, len(raw), 3)
               if abs(raw[i] - rgb[0]) + abs(raw[i + 1] - rgb[1]) + abs(raw[i + 2] - rgb[2]) <= tol)
