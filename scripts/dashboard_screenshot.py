"""Screenshots /dashboard while `radixserve bench serve` loads a real server (docs/dashboard.png).

    python scripts/dashboard_screenshot.py [--model PATH] [--seconds 25] [--out docs/dashboard.png]

Starts `radixserve serve` (default: SmolLM2) on a free loopback port, opens the dashboard
in headless system Chromium (Playwright), starts a small shared-prefix bench against the
server, and takes the screenshot `--seconds` later, while the bench still runs. One thread
per process (OMP_NUM_THREADS=1): the picture is of the page, not of a speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = "num_groups=4,prompts_per_group=12,system_len=256,question_len=32,output_len=24"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "radixserve.cli", "serve", *([model] if model else [])]
    proc = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    for line in proc.stdout:
        if "ready at" in line:
            return proc
    raise RuntimeError(f"server exited with code {proc.wait()}")


def start_bench(url: str, env: dict, out: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "radixserve.cli", "bench", "serve", "--url", url,
        "--workload", "shared-prefix", "--workload-args", WORKLOAD, "--request-rate", "2",
        "--num-warmup", "0", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model for `serve` (default: SmolLM2)")
    parser.add_argument("--seconds", type=float, default=25.0, help="bench time before the shot")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("no chromium on this machine (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    env = os.environ | {"OMP_NUM_THREADS": "1"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port, env)
    bench = None
    try:
        with sync_playwright() as p:
            page = p.chromium.launch(executable_path=browser).new_page(
                viewport={"width": 1280, "height": 1100}
            )
            page.goto(url + "/dashboard")
            bench = start_bench(url, env, Path(tempfile.mkdtemp(prefix="dashboard_bench")))
            time.sleep(args.seconds)
            page.screenshot(path=str(args.out), full_page=True)
        print(f"wrote {args.out}")
    finally:
        if bench is not None:
            bench.terminate()
            bench.wait()
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
