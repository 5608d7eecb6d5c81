"""The one-shot GPU device check: install, cuda-marked tests, GPU benchmark.

    python3 -m bench.gpu.check OUTDIR [--budget-s 330]     (bench/gpu_check.sh wraps it)

Steps, each recorded in OUTDIR/report.json as soon as it ends (a run cut
short still says how far it got):

1. ``probe``: Python, torch and CUDA as the machine has them, nvidia-smi,
   /dev/shm, a C compiler and Python's headers.
2. ``venv``: a virtual environment over the machine's own packages
   (``--system-site-packages --without-pip``: pip and torch come from the
   machine), in a temporary directory, so nothing global changes.
3. ``wheels``: from bench/gpu_wheels/ (filled by bench/gpu/wheels.sh) the
   wheels of the packages the machine lacks, or has older than
   pyproject.toml requires; nothing is downloaded (``--no-index``).
4. ``install``: ``pip install --no-deps --no-build-isolation -e .``, which
   builds the C extensions there; their import is checked, and that of the
   client, sidecar and HF adapter.
5. ``tests``: ``pytest -m cuda`` over the test modules that hold cuda-marked
   tests, junit XML and log to OUTDIR, every case in the report.
6. ``bench``: ``python -m bench.gpu.copy_path`` (``--quick`` when little time
   is left); without a GPU its sections are skipped and its ``--selftest-cpu`` runs instead, to
   check the benchmark code itself.

Everything skipped is listed with why, in the report and at the end of the
output. Exit status 0: the check passed, or a complete dry run without a GPU;
1: a step or a test failed. Runs in one process, the steps as children with
deadlines inside ``--budget-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from harness import REPO

WHEELS = REPO / "bench" / "gpu_wheels"
# What the project needs beyond the GPU machine's own packages, then what the
# check runs (pytest); bench/gpu/wheels.sh downloads the same list.
WANTED = ["blake3", "lmdb", "zstandard", "grpcio-health-checking", "grpcio", "protobuf",
          "pytest", "pluggy", "iniconfig", "pygments", "pytest-timeout", "packaging",
          "setuptools"]  # fmt: skip
# Beyond pyproject.toml: setuptools builds the editable install without the
# `wheel` package from 70.1 on (nothing else could be installed there).
CHECK_MINIMUMS = {"setuptools": ">=70.1"}
BENCH_RESERVE_S = 75.0  # kept for the benchmark while the tests run
QUICK_BENCH_BELOW_S = 90.0  # less left than this: bench.gpu.copy_path --quick
PROBE = """
import json, torch
out = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
       "cuda_available": torch.cuda.is_available()}
if out["cuda_available"]:
    out["device"] = torch.cuda.get_device_name()
    out["capability"] = list(torch.cuda.get_device_capability())
    out["device_count"] = torch.cuda.device_count()
    free, total = torch.cuda.mem_get_info()
    out["memory_free_bytes"], out["memory_total_bytes"] = free, total
for name in ("transformers", "grpc", "google.protobuf", "numpy", "prometheus_client", "cupy"):
    try:
        mod = __import__(name, fromlist=["__version__"])
        out[name] = getattr(mod, "__version__", "?")
    except Exception as e:
        out[name] = f"missing: {type(e).__name__}: {e}"
print(json.dumps(out))
"""
INSTALLED = """
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""
IMPORTS = """
import json, tierstore, tierstore._chainhash, tierstore.memory._fastcopy
import tierstore.client, tierstore.sidecar.process, tierstore.engines.hf
print(json.dumps({"tierstore": tierstore.__file__,
                  "_chainhash": tierstore._chainhash.__file__,
                  "_fastcopy": tierstore.memory._fastcopy.__file__}))
"""


class Check:
    """The report being built, written to OUTDIR/report.json after each step."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.report: dict[str, Any] = {
            "check": "tierstore GPU device check (issue 17)",
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "budget_s": budget_s,
            "status": "incomplete",
            "steps": {},
            "skipped": [],
        }
        self.write()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        tmp.replace(self.out / "report.json")

    def step(self, name: str, status: str, t0: float, **detail: Any) -> None:
        entry = {"status": status, "elapsed_s": round(time.monotonic() - t0, 1), **detail}
        self.report["steps"][name] = entry
        print(f"gpu_check: {name}: {status} ({entry['elapsed_s']} s)", flush=True)
        if status == "skipped":
            self.skip(name, str(detail.get("reason", "")))
        self.write()

    def skip(self, what: str, why: str) -> None:
        self.report["skipped"].append({"what": what, "why": why})


def run(cmd: list[str], timeout_s: float, log: Path | None = None, **kw: Any) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; (exit status, its output), 124
    when it ran out of time (then the whole group is killed: a test's
    sidecars too). With ``log`` the output also goes there."""
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, **kw,
        )  # fmt: skip
    except OSError as e:
        rc, text = 127, f"{type(e).__name__}: {e}"
    else:
        try:
            text, _ = proc.communicate(timeout=max(timeout_s, 1.0))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            rc = 124
            text += f"\n[gpu_check: stopped after {timeout_s:.0f} s]\n"
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{text}\n[exit {rc}]\n")
    return rc, text


def last_json(text: str) -> Any:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in: {text[-500:]}")


def probe(check: Check) -> dict[str, Any]:
    t0 = time.monotonic()
    host: dict[str, Any] = {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cc": shutil.which("cc") or shutil.which("gcc"),
        "python_h": (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if os.path.isdir("/dev/shm"):
        host["dev_shm_free_bytes"] = shutil.disk_usage("/dev/shm").free
    if shutil.which("nvidia-smi"):
        q = "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max"
        rc, text = run(["nvidia-smi", q, "--format=csv,noheader"], 30)
        host["nvidia_smi"] = text.strip() if rc == 0 else f"exit {rc}: {text.strip()[-300:]}"
    else:
        host["nvidia_smi"] = None
    rc, text = run([sys.executable, "-c", PROBE], 120)
    try:
        host.update(last_json(text))
    except ValueError:
        host["torch_probe_error"] = text[-2000:]
    rc, text = run(["git", "-C", str(REPO), "rev-parse", "HEAD"], 10)
    host["commit"] = text.strip() if rc == 0 else None
    check.report["host"] = host
    ok = "torch" in host
    check.step("probe", "ok" if ok else "failed", t0)
    return host


def make_venv(check: Check, where: Path) -> Path | None:
    t0 = time.monotonic()
    venv = where / "venv"
    rc, text = run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], 60)  # fmt: skip
    py = venv / "bin" / "python"
    if rc == 0:
        rc, text = run([str(py), "-m", "pip", "--version"], 60)
    if rc != 0:
        check.step("venv", "failed", t0, output=text[-2000:])
        return None
    check.step("venv", "ok", t0, path=str(venv), pip=text.strip())
    return py


def requirements() -> dict[str, str]:
    """pyproject.toml's dependency and build specifiers by normalised name,
    joined with the check's own minimums."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"] + project["build-system"]["requires"]
    out: dict[str, str] = {}
    for dep in deps:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*([^;]*)", dep)
        if m:
            out[norm(m.group(1))] = m.group(2).strip()
    for name, spec in CHECK_MINIMUMS.items():
        out[name] = ",".join(x for x in (out.get(name, ""), spec) if x)
    return out


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def satisfies(version: str, spec: str) -> bool:
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        # pip's vendored copy: the same API, but to mypy a distinct class
        from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[assignment]
    return SpecifierSet(spec).contains(version, prereleases=True)


def install_wheels(check: Check, py: Path, force: list[str]) -> None:
    """Install the carried wheel of each package the venv lacks, or has at a
    version pyproject.toml does not accept; ``force`` names packages to
    install from their wheel anyway (a dry run's test of this step)."""
    t0 = time.monotonic()
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    by_name = {norm(w.name.split("-")[0]): w for w in wheels}
    rc, text = run([str(py), "-c", INSTALLED, *WANTED], 60)
    have: dict[str, str | None] = last_json(text) if rc == 0 else {}
    reqs = requirements()
    plan: list[dict[str, Any]] = []
    for name in WANTED:
        version, spec = have.get(name), reqs.get(name, "")
        if version is not None and satisfies(version, spec) and name not in force:
            plan.append({"name": name, "version": version, "from": "machine"})
            continue
        why = "missing" if version is None else f"machine has {version}, needs {spec!r}"
        if name in force:
            why = "forced (--force-wheel)"
        plan.append({"name": name, "from": "wheel", "why": why,
                     "wheel": by_name[name].name if name in by_name else None})  # fmt: skip
    check.report["packages"] = plan
    todo = [p for p in plan if p["from"] == "wheel"]
    absent = [p["name"] for p in todo if p["wheel"] is None]
    if absent:
        check.step("wheels", "failed", t0, reason=f"no carried wheel for {absent}: run "
                   "bench/gpu/wheels.sh and carry bench/gpu_wheels")  # fmt: skip
        return
    if not todo:
        why = "every package is on the machine at a version pyproject.toml accepts"
        check.step("wheels", "skipped", t0, reason=why)
        return
    files = [str(WHEELS / p["wheel"]) for p in todo]
    pip = [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed"]
    cmd = [*pip, "--disable-pip-version-check", *files]
    rc, text = run(cmd, min(120, check.left_s()), check.out / "install.log")
    status = "ok" if rc == 0 else "failed"
    check.step("wheels", status, t0, installed=[p["wheel"] for p in todo], output=text[-1500:])


def install_project(check: Check, py: Path) -> bool:
    t0 = time.monotonic()
    cmd = [str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-e", str(REPO)]  # fmt: skip
    rc, text = run(cmd, min(240, check.left_s()), check.out / "install.log", cwd=REPO)
    if rc != 0:
        check.step("install", "failed", t0, output=text[-3000:])
        return False
    # Outside the tree: the import must come from the installed (editable) project.
    rc, text = run([str(py), "-c", IMPORTS], 120, check.out / "install.log", cwd="/",
                   env=env_without_pythonpath())  # fmt: skip
    if rc != 0:
        check.step("install", "failed", t0, imports=text[-3000:])
        return False
    check.step("install", "ok", t0, modules=last_json(text))
    return True


def env_without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_tests(check: Check, py: Path) -> None:
    t0 = time.monotonic()
    xml, log = check.out / "cuda-tests.xml", check.out / "cuda-tests.log"
    # Only the modules that hold cuda-marked tests: collecting the whole suite
    # would import what the check does not carry (hypothesis, ...) and one
    # collection error stops pytest before any test runs.
    files = cuda_test_files()
    check.report["cuda_test_files"] = files
    cmd = [str(py), "-m", "pytest", "-m", "cuda", "-rA", "-p", "no:cacheprovider",
           "-o", "timeout=150", f"--junitxml={xml}", *files]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    timeout_s = check.left_s() - BENCH_RESERVE_S
    rc, text = run(cmd, timeout_s, log, cwd=REPO, env=env)
    tests: dict[str, Any] = parse_junit(xml) if xml.exists() else {"error": "no junit XML written"}
    tests["exit_status"] = rc
    tests["tail"] = text[-3000:]
    check.report["tests"] = tests
    for reason, count in tests.get("skip_reasons", {}).items():
        check.skip(f"{count} cuda test(s)", reason)
    bad = tests.get("failed", 0) + tests.get("errors", 0)
    # pytest: 0 all passed, 5 nothing collected/selected; a skip-only run is 0.
    status = "ok" if rc == 0 and not bad else "failed"
    check.step("tests", status, t0, counts={k: tests.get(k) for k in
                                            ("passed", "failed", "errors", "skipped")})  # fmt: skip


def cuda_test_files() -> list[str]:
    """Test modules under tests/ that carry the cuda marker, relative to REPO."""
    marker = re.compile(r"pytest\.mark\.cuda\b")
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if marker.search(p.read_text(errors="replace"))
    )


def parse_junit(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    cases: list[dict[str, Any]] = []
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons: dict[str, int] = {}
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "")[:2000]
                if outcome != "skipped" and child.text:
                    message += "\n" + child.text[-3000:]
        counts[outcome] += 1
        if outcome == "skipped":
            reasons[message] = reasons.get(message, 0) + 1
        cases.append({
            "id": f"{case.get('classname')}::{case.get('name')}",
            "outcome": outcome.rstrip("s") if outcome == "errors" else outcome,
            "time_s": float(case.get("time") or 0.0),
            **({"message": message} if message else {}),
        })  # fmt: skip
    return {**counts, "skip_reasons": reasons, "cases": cases}


def run_bench(check: Check, py: Path, has_gpu: bool) -> None:
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = ["--json"]
    if has_gpu and check.left_s() < QUICK_BENCH_BELOW_S:
        args.append("--quick")
    if not has_gpu:
        args.append("--selftest-cpu")
    log = check.out / "bench.log"
    cmd = [str(py), "-m", "bench.gpu.copy_path", *args]
    rc, text = run(cmd, check.left_s() - 5, log, cwd=REPO, env=env)
    try:
        start = text.index("{")
        bench = json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError:
        check.step("bench", "failed", t0, args=args, output=text[-3000:])
        return
    (check.out / "bench.json").write_text(json.dumps(bench, indent=2) + "\n")
    check.report["bench"] = bench
    if not has_gpu:
        check.skip("bench: every GPU figure", check.report["host"].get("why_no_gpu", ""))
    for name, section in bench.items():
        if isinstance(section, dict) and "skipped" in section:
            check.skip(f"bench: {name}", section["skipped"])
    errors = [n for n, s in bench.items() if isinstance(s, dict) and "error" in s]
    status = "ok" if rc == 0 and not errors else "failed"
    check.step("bench", status, t0, args=args, errors=errors)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="folder for report.json and the logs")
    p.add_argument("--budget-s", type=float, default=330.0, help="all steps end within this")
    p.add_argument("--force-wheel", action="append", default=[], metavar="NAME",
                   help="install NAME's carried wheel even if the machine has it")  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("report.json", "install.log", "cuda-tests.xml", "cuda-tests.log", "bench.json",
                  "bench.log"):  # fmt: skip
        (args.out / stale).unlink(missing_ok=True)
    check = Check(args.out, args.budget_s)
    host = probe(check)
    has_gpu = bool(host.get("cuda_available"))
    if not has_gpu:
        why = (f"no CUDA device: torch {host.get('torch', '?')} reports "
               "torch.cuda.is_available() False")  # fmt: skip
        host["why_no_gpu"] = why
        print(f"gpu_check: DRY RUN ({why}): every CUDA part is skipped", flush=True)
    with tempfile.TemporaryDirectory(prefix="tierstore-gpucheck-") as tmp:
        py = make_venv(check, Path(tmp))
        if py is not None:
            install_wheels(check, py, [norm(n) for n in args.force_wheel])
            if install_project(check, py):
                run_tests(check, py)
                run_bench(check, py, has_gpu)
    steps = check.report["steps"]
    failed = [n for n, s in steps.items() if s["status"] == "failed"]
    done = all(n in steps for n in ("probe", "venv", "install", "tests", "bench"))
    if failed or not done:
        check.report["status"] = "failed" if failed else "incomplete"
    else:
        check.report["status"] = "passed" if has_gpu else "dry run: no GPU, every CUDA part skipped"
    check.report["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    check.write()
    print(f"gpu_check: {check.report['status']} in {check.report['elapsed_s']} s; "
          f"failed steps: {failed or 'none'}")  # fmt: skip
    for s in check.report["skipped"]:
        print(f"gpu_check: SKIPPED {s['what']}: {s['why']}")
    tests = check.report.get("tests", {})
    for case in tests.get("cases", []):
        if case["outcome"] in ("failed", "error"):
            print(f"gpu_check: FAILED {case['id']}: {case.get('message', '')[:300]}")
    print(f"gpu_check: report in {args.out / 'report.json'}")
    return 0 if check.report["status"] != "failed" and done else 1


if __name__ == "__main__":
    sys.exit(main())
