"""Every command the README and docs/ show is run.

Each page's fenced `bash` blocks run in order, one command after another, in a fresh
directory holding the repository's `deploy/` and `data/` (as a user's checkout has them),
with `TRACES` pointing at the public traces. A YAML block whose first line is `# NAME.yaml`
is written to NAME.yaml first, so a command's `-f NAME.yaml` reads what the page shows. A
block in another shell language fails the test: nothing slips past by its tag.

What cannot run as shown runs as a documented equivalent (docs/development.md), each
named below with its reason:
- `helm install|upgrade` renders the chart as `helm template` does (Helm v4's own engine,
  through helm-python-sdk), against a cluster serving every setup's custom resources, and
  keeps the release's values for a later `--reuse-values`;
- a command that runs until Ctrl-C is started, checked alive (`serve` answering
  `/healthz`), left up for the page's later commands and then stopped with SIGINT;
- a slow command runs with small arguments (FAST), on the same subcommand;
- `make demo` is checked to be `gpuscale demo --out reports/demo`, which
  tests/test_demo.py runs on a short workload; `make test` is what CI runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import TRACES, require_service

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"sh", "shell", "console", "zsh", "shell-session", "bash-session"}

# Documented command -> what the test runs instead (same subcommand, smaller inputs).
FAST = {
    # Four days instead of fourteen: every later command (train, scale, retrain) fits on it.
    "gpuscale generate --out demo-data --days 14": "gpuscale generate --out demo-data --days 4",
    # The default model's six horizons take minutes to train; the cheap empirical model is
    # registered under the same name, so forecast and models read what the docs show.
    "gpuscale train --state-dir .gpuscale/state --registry models": (
        "gpuscale train --state-dir .gpuscale/state --registry models"
        " --model empirical --name gpuscale"
    ),
    "gpuscale retrain --state-dir .gpuscale/state --registry models": (
        "gpuscale retrain --state-dir .gpuscale/state --registry models --model empirical"
    ),
    "gpuscale shadow-day --config deploy/live-simulated.yaml --state-dir shadow": (
        "gpuscale shadow-day --config deploy/live-simulated.yaml --state-dir shadow"
        " --history-days 2 --steps 12"
    ),
    "gpuscale simulate --trace series:demo-data/demand.csv --gpus-per-node 8 --out sim-replay/": (
        "gpuscale simulate --trace series:demo-data/demand.csv --gpus-per-node 8"
        " --out sim-replay/ --model empirical"
    ),
    # Three days (the least the synthetic simulation takes) at one knob, not 21 days at three.
    "gpuscale simulate --synthetic --frontier --knob 0.05 --knob 0.1 --knob 0.2 --out sim/": (
        "gpuscale simulate --synthetic --frontier --knob 0.1 --days 3 --out sim/"
    ),
    # The benchmarks on one Helios VC's last two days, not every trace's test window.
    "gpuscale bench forecast --trace philly:$TRACES/philly/philly_node_sequence.csv.gz"
    " $(for f in $TRACES/helios-earth/*.csv.gz; do echo --trace helios-vc:$f; done)"
    " --json forecast.json": (
        "gpuscale bench forecast --trace helios-vc:$TRACES/helios-earth/vcTJs.csv.gz"
        " --split 2020-05-30 --models empirical --json forecast.json"
    ),
    "gpuscale bench scaling --trace philly:$TRACES/philly/philly_node_sequence.csv.gz"
    " $(for f in $TRACES/helios-earth/*.csv.gz; do echo --trace helios-vc:$f; done)"
    " --lag 0 --lag 1 --knob 0.001 --knob 0.003 --knob 0.01 --knob 0.03 --knob 0.1"
    " --walks 20 --json scaling.json": (
        "gpuscale bench scaling --trace helios-vc:$TRACES/helios-earth/vcTJs.csv.gz"
        " --split 2020-05-30 --model empirical --lag 0 --knob 0.01 --walks 2"
        " --json scaling.json"
    ),
    "gpuscale bench placement --nodes $TRACES/alibaba-openb/openb_node_list_gpu_node.csv"
    " --pods $TRACES/alibaba-openb/openb_pod_list_default.csv --seeds 42-51 --workers 2"
    " --json placement.json": (
        "gpuscale bench placement --nodes $TRACES/alibaba-openb/openb_node_list_gpu_node.csv"
        " --pods $TRACES/alibaba-openb/openb_pod_list_default.csv --seeds 42"
        " --policies gpuscale --workers 1 --json placement.json"
    ),
    # A 30-node cluster, not 1,000 to 10,000 (minutes each: docs/large-clusters.md's table).
    **{
        f"gpuscale bench loop --nodes {nodes} --pods {pods} --passes 10 --extender-pods 200"
        f" --json loop-{name}.json": "gpuscale bench loop --nodes 30 --pods 600 --passes 2"
        f" --extender-pods 5 --json loop-{name}.json"
        for nodes, pods, name in ((1000, 30000, "1k"), (5000, 150000, "5k"), (10000, 300000, "10k"))
    },
    "gpuscale bench service --nodes $TRACES/alibaba-openb/openb_node_list_gpu_node.csv": (
        "gpuscale bench service --nodes $TRACES/alibaba-openb/openb_node_list_gpu_node.csv"
        " --seconds 1"
    ),
}
# Run by another test, or by CI itself.
ELSEWHERE = {
    "make demo": "tests/test_demo.py runs `gpuscale demo` (the recipe, checked below) on 8 days",
    "make test": "CI runs it (.ci/run)",
}
# Commands that run until Ctrl-C.
UNTIL_INTERRUPTED = ("gpuscale scale --config deploy/live-simulated.yaml --apply --interval",)
SERVE = re.compile(r"\bgpuscale serve\b.*--port (\d+)")
TIMEOUT_S = 900  # one command, on a loaded two-core machine


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str


def blocks(page: Path) -> list[Block]:
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number, []
            else:
                out.append(Block(page, start, lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def commands(block: Block) -> list[str]:
    """The block's commands, continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", block.text)
    lines = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in joined.splitlines())
    return [line for line in lines if line]  # comments, to the line's end, left out


def documented() -> list[tuple[Path, str]]:
    return [(b.page, c) for p in PAGES for b in blocks(p) if b.lang == "bash" for c in commands(b)]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def test_every_shell_block_is_bash_so_the_runner_sees_it() -> None:
    others = [f"{_name(b.page)}:{b.line} ({b.lang})" for p in PAGES for b in blocks(p)]
    others = [o for o in others if o.rsplit("(", 1)[1].rstrip(")") in SHELLS]
    assert not others, f"use ```bash for commands: {others}"


def test_every_substitution_is_for_a_documented_command() -> None:
    shown = {c for _, c in documented()}
    assert not set(FAST) - shown, "a FAST entry names no command the docs show"
    assert not set(ELSEWHERE) - shown
    for command, fast in FAST.items():
        assert fast.split()[:2] == command.split()[:2], command  # the same subcommand


def test_make_demo_is_the_demo_command() -> None:
    # Under `make test` this make is a sub-make, which would print its directory too.
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert recipe[-1] == ".venv/bin/gpuscale demo --out reports/demo"


def test_no_page_points_outside_the_repository() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert "../shared" not in text and "/work/" not in text, _name(page)


HELM_SHIM = '''\
"""`helm install|upgrade|template` as `helm template` renders it (the test's stand-in)."""
import json, os, sys
from pathlib import Path

import helm_python as helm
import yaml
from helm_python import _native

CRDS = [
    "monitoring.coreos.com/v1/ServiceMonitor", "autoscaling.x-k8s.io/v1beta1/CapacityBuffer",
    "karpenter.sh/v1/NodePool", "kueue.x-k8s.io/v1beta2/Workload",
]
state = Path(os.environ["HELM_STATE"])
verb, *rest = sys.argv[1:]
positional, values, reuse, install, namespace, i = [], {}, False, False, "default", 0


def merge(into, more):
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def scalar(text):
    return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)


sets, files = [], []
while i < len(rest):
    arg = rest[i]
    if arg in ("-n", "--namespace"):
        namespace, i = rest[i + 1], i + 2
    elif arg == "--set":
        sets.append(rest[i + 1]); i += 2
    elif arg in ("-f", "--values"):
        files.append(rest[i + 1]); i += 2
    elif arg == "--reuse-values":
        reuse, i = True, i + 1
    elif arg == "--install":
        install, i = True, i + 1
    elif arg == "--create-namespace":
        i += 1
    elif arg.startswith("-"):
        sys.exit(f"helm shim: unknown flag {arg}")
    else:
        positional.append(arg); i += 1
release, chart = positional
saved = state / f"{release}.json"
if reuse and (saved.exists() or not install):
    if not saved.exists():
        sys.exit(f"Error: UPGRADE FAILED: release {release} not found")
    values = json.loads(saved.read_text())
for name in files:
    merge(values, yaml.safe_load(Path(name).read_text()) or {})
for item in sets:
    key, _, text = item.partition("=")
    node = values
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = scalar(text)
options = {"name": release, "namespace": namespace, "kube_version": "v1.30.0",
           "api_versions": CRDS}
with helm.Chart.load(chart) as loaded:
    try:
        text = _native.call_string("helm_render", loaded._raw(), json.dumps(values),
                                   json.dumps(options))
    except Exception as exc:
        sys.exit(f"Error: {exc}")
rendered = json.loads(text)
docs = [d for path, t in rendered.items() if path.endswith(".yaml")
        for d in yaml.safe_load_all(t) if d]
scaler = next(d for d in docs if d["kind"] == "StatefulSet")
args = scaler["spec"]["template"]["spec"]["containers"][0]["args"]
saved.write_text(json.dumps(values))
with (state / "history.jsonl").open("a") as log:
    log.write(json.dumps({"verb": verb, "release": release, "scaler_args": args}) + "\\n")
print(f"rendered {len(docs)} objects; scaler: {' '.join(args)}")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "helm"
    shim.write_text(f"#!{sys.executable}\n" + HELM_SHIM)
    shim.chmod(0o755)
    (tmp / ".helm").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCALE_")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        HELM_STATE=str(tmp / ".helm"),
        TRACES=str(TRACES),
        MPLBACKEND="Agg",
        PYTHONPATH=str(ROOT),
    )
    return env


def _wait_healthy(port: int, process: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve exited {process.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"serve did not answer /healthz on {port} in {timeout:.0f} s")


def _stop(process: subprocess.Popen, command: str) -> None:
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as the docs say
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"{command!r} did not stop on Ctrl-C") from None
    output = process.stdout.read() if process.stdout else ""
    assert process.returncode in (0, 130, -signal.SIGINT), f"{command}: {output[-2000:]}"


def run_page(page: Path, tmp: Path) -> list[tuple[str, str]]:
    """Run the page's commands; returns (command run, its output) in order."""
    for name in ("deploy", "data"):
        (tmp / name).symlink_to(ROOT / name)
    (tmp / "docs").mkdir()  # where the configuration reference is written
    env = _environment(tmp)
    port = str(_free_port())
    ran: list[tuple[str, str]] = []
    background: list[tuple[subprocess.Popen, str]] = []
    try:
        for block in blocks(page):
            first = block.text.splitlines()[0] if block.text else ""
            if block.lang == "yaml" and re.fullmatch(r"# [\w.-]+\.yaml", first):
                (tmp / first[2:]).write_text(block.text + "\n")
            if block.lang != "bash":
                continue
            for command in commands(block):
                if command in ELSEWHERE:
                    continue
                actual = FAST.get(command, command)
                # The docs' port may be taken on a shared machine: a free one instead.
                served = SERVE.search(actual)
                actual = re.sub(r"\b8080\b", port, actual)
                if served or actual.startswith(UNTIL_INTERRUPTED):
                    process = subprocess.Popen(
                        ["bash", "-c", actual], cwd=tmp, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                    background.append((process, actual))
                    if served:
                        _wait_healthy(int(port), process)
                    else:
                        time.sleep(10)
                        assert process.poll() is None, f"{actual!r} exited {process.returncode}"
                    ran.append((actual, ""))
                    continue
                result = subprocess.run(
                    ["bash", "-c", f"set -o pipefail; {actual}"], cwd=tmp, env=env,
                    capture_output=True, text=True, timeout=TIMEOUT_S,
                )  # fmt: skip
                output = result.stdout + result.stderr
                assert result.returncode == 0, (
                    f"{_name(page)}: {actual!r} exited {result.returncode}:\n{output[-3000:]}"
                )
                ran.append((actual, output))
    finally:
        for process, command in reversed(background):
            _stop(process, command)
    return ran


def _needs_traces(page: Path) -> bool:
    return "$TRACES" in "".join(c for p, c in documented() if p == page)


@pytest.mark.parametrize("page", [p for p in PAGES if any(p == q for q, _ in documented())],
                         ids=_name)  # fmt: skip
def test_the_pages_commands_run(page: Path, tmp_path: Path) -> None:
    if _needs_traces(page) and not TRACES.is_dir():
        require_service(f"the public traces are not at {TRACES}")
    ran = run_page(page, tmp_path)
    assert ran
    history = tmp_path / ".helm" / "history.jsonl"
    if page.name == "README.md":
        # Shadow first, then acting: what the five steps promise.
        steps = [json.loads(line) for line in history.read_text().splitlines()]
        assert [s["verb"] for s in steps] == ["install", "upgrade"]
        assert "--shadow" in steps[0]["scaler_args"] and "--apply" not in steps[0]["scaler_args"]
        assert "--apply" in steps[1]["scaler_args"] and "--shadow" not in steps[1]["scaler_args"]
        assert (tmp_path / "shadow-report" / "report.md").is_file()
    if page.name == "configuration.md":
        generated = tmp_path / "docs" / "configuration.md"
        assert generated.read_text() == (ROOT / "docs" / "configuration.md").read_text()


def test_a_failing_documented_command_fails_the_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        ```yaml
        # values.yaml
        scaler: {apply: true, shadow: true}
        ```

        ```bash
        helm install gpuscale deploy/helm/gpuscale -f values.yaml
        ```
        """))  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(AssertionError, match=r"set scaler\.apply false"):
        run_page(page, work)


def test_shlex_reads_every_command() -> None:
    for page, command in documented():
        assert shlex.split(command), f"{_name(page)}: {command!r}"
