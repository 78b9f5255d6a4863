"""Runs the GPU kit's steps in order, each in its own process, into one JSON and one log.

    python bench/gpu/driver.py [--tier 1|2|all] [--rehearse] [--out DIR] [--budget-s S] [--only a,b]
                               [--build-here] [--use-env] [--commit SHA[+dirty]]

(bash bench/gpu/run.sh is the way in; docs/gpu.md says what each step measures.)

* Setup steps run first in every call (a second call may land on a fresh machine): machine,
  install-kit, extension, and te-extension for tier 2. Later steps that need a setup step
  that failed are skipped, with that reason; independent steps still run.
* Each step gets its own timeout, cut to what is left of ``--budget-s`` (the call's limit),
  and is told its deadline (GPU_KIT_STEP_DEADLINE): the measuring steps stop starting new
  cases before it and write what they measured. A step that cannot start with its ``min_s``
  left is recorded as skipped.
* Each tier's steps are ordered by importance, so that a call short of time loses the least:
  tier 1 the unverified kernels' tests, the sanitizer and the kernel bench first; tier 2 the TE
  layer bench and the model bench first.
* The record says what ran: the commit (and whether the tree differed from it) and the hash of
  the extension's sources (kit_abi.py source-hash). The device tool's copy of the tree has no
  .git, so there the commit is the one ``--commit`` names (the launching session pastes
  ``git rev-parse HEAD``, with ``+dirty`` for uncommitted changes, into the command).
* After every step OUT/gpu-results.json is rewritten (a call killed at its limit still leaves
  what was measured), and OUT/gpu-run.log gets every step's output as it is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MIN_STEP_S = 20  # a step started with less time than this left could not finish anything
DEADLINE_ENV = "GPU_KIT_STEP_DEADLINE"  # common.py reads it
if str(HERE) not in sys.path:  # kit_abi and report, also where this file is loaded by path (tests)
    sys.path.insert(0, str(HERE))


@dataclass(frozen=True)
class Step:
    name: str
    script: str  # under bench/gpu
    tier: int  # 0: setup, run in every call
    timeout_s: int  # on the lent H200
    needs: Tuple[str, ...] = ()  # setup steps it cannot run without
    te: bool = False  # sees Transformer Engine's target on its path
    expected_s: int = 0  # the estimate on the H200 (docs/gpu.md gives its basis)
    min_s: int = MIN_STEP_S  # skipped rather than started with less left (steps without a deadline of their own)


KIT = ("install-kit", "extension")
TE = KIT + ("te-extension",)
# expected_s: the 2026-12-01 H200 run's times (bench/gpu/results/2026-12-01), scaled by what each
# step now does (docs/gpu.md, "What runs, and the budget")
STEPS = (
    Step("machine", "setup_steps.py", 0, 60, expected_s=5),
    Step("install-kit", "setup_steps.py", 0, 120, expected_s=15),
    Step("extension", "setup_steps.py", 0, 420, needs=("install-kit",), expected_s=7),
    Step("kernel-tests", "kernel_bench.py", 1, 200, needs=KIT, expected_s=60, min_s=40),
    Step("compute-sanitizer", "kernel_bench.py", 1, 240, needs=KIT, expected_s=150, min_s=60),
    Step("kernel-bench", "kernel_bench.py", 1, 300, needs=KIT, expected_s=130, min_s=60),
    Step("layer-bench", "layers.py", 1, 150, needs=KIT, expected_s=35, min_s=40),
    Step("train-bf16", "training.py", 1, 240, needs=KIT, expected_s=85, min_s=110),
    # new (issue 50): the CPU's host-cost bench with its layers on the GPU; never run there yet
    Step("host-cost", "layers.py", 1, 90, needs=KIT, expected_s=30, min_s=40),
    Step("te-extension", "setup_steps.py", 2, 420, needs=("install-kit",), expected_s=22),
    Step("te-layer-bench", "layers.py", 2, 180, needs=TE, te=True, expected_s=50, min_s=40),
    Step("model-bench", "model_bench.py", 2, 330, needs=TE, te=True, expected_s=210, min_s=90),
    # (issue 19: both also run the hybrid variant on TE; te-check only with time left in its 150 s)
    Step("te-vs-local", "te_parity.py", 2, 120, needs=TE, te=True, expected_s=30, min_s=40),
    Step("te-check", "te_check.py", 2, 150, needs=TE, te=True, expected_s=45, min_s=40),
    # new (issue 19): before fp8-training, which passed on 2026-12-01 and tests no new code
    Step("moe-training", "training.py", 2, 150, needs=TE, te=True, expected_s=50, min_s=60),
    Step("fp8-training", "training.py", 2, 240, needs=TE, te=True, expected_s=106, min_s=130),
)


def selected(tiers: List[int], only: Optional[List[str]]) -> List[Step]:
    """The steps of ``tiers`` (setup steps always), in order; ``only`` narrows them to the named
    steps, the setup steps those need, and "machine"."""
    steps = [s for s in STEPS if s.tier == 0 or s.tier in tiers]
    if only:
        unknown = set(only) - {s.name for s in STEPS}
        if unknown:
            raise SystemExit(f"unknown steps {sorted(unknown)}; steps: {', '.join(s.name for s in STEPS)}")
        # and always "machine": the record's device, driver and versions
        wanted = set(only) | {"machine"} | {need for s in STEPS if s.name in only for need in s.needs}
        steps = [s for s in steps if s.name in wanted]
    return steps


def provenance(root: Path = ROOT, given: Optional[str] = None) -> dict:
    """What this run ran: the commit (``given``, "SHA" or "SHA+dirty", from --commit, which the
    launching session pastes; else git rev-parse HEAD where ``root`` is a git checkout), whether
    the tree differs from it, the kit's commit, and kit_abi.py's hash of the extension's sources.
    --commit wins over git: the device tool's copy once carried a .git of an older commit."""
    import kit_abi  # noqa: E402 - bench/gpu is on the path (above)

    record = {"source_hash": kit_abi.source_hash(root)}
    if given:
        head, _, flag = given.partition("+")
        record["commit"] = {"head": head, "dirty": flag == "dirty", "from": "--commit"}
    else:
        record["commit"] = git_commit(root)
    try:
        record["commit"]["kit"] = json.loads((root / ".gpu-kit" / "manifest.json").read_text()).get("commit")
    except (OSError, ValueError):
        record["commit"]["kit"] = None
    return record


def git_commit(root: Path) -> dict:
    """HEAD of the git checkout ``root`` and whether its tree differs, or why there is none."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            raise RuntimeError(f"{root} is inside another git checkout, not one of its own")
        return {"head": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        why = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else str(error)
        return {"head": None, "dirty": None, "why": f"no git checkout here: {why}"[:300]}


class Run:
    """The call's record: OUT/gpu-results.json, OUT/gpu-run.log, and progress on stdout."""

    def __init__(self, out: Path, budget_s: float, rehearse: bool, tiers: List[int], work: Path,
                 commit: Optional[str] = None):
        self.out, self.budget_s, self.rehearse, self.work = out, budget_s, rehearse, work
        self.start = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu-results.json", out / "gpu-run.log"
        self.log = open(self.log_path, "a", buffering=1)
        self.record = {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rehearsal": rehearse, "tiers": tiers, "budget_s": budget_s, **provenance(given=commit), "steps": {},
        }
        self.save()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, text: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        self.record["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str))
        os.replace(tmp, self.json_path)

    def environment(self, step: Step, timeout: float) -> dict:
        sites = [str(ROOT), str(self.work / "site")] + ([str(self.work / "site-te")] if step.te else [])
        # torch's JIT extensions (megatron-core 0.19's recompute builds one at first use) in the run's
        # own folder: a shared ~/.cache/torch_extensions holds other torches' builds, and a build
        # killed there leaves a lock every later one waits on for good (a rehearsal's model-bench did)
        return dict(os.environ, PYTHONPATH=os.pathsep.join(sites), PYTHONUNBUFFERED="1",
                    GPU_KIT_WORK=str(self.work), TORCH_EXTENSIONS_DIR=str(self.work / "torch_extensions"),
                    **{DEADLINE_ENV: f"{time.time() + timeout:.1f}"})

    def run_step(self, step: Step) -> None:
        record = {"tier": step.tier}
        self.record["steps"][step.name] = record
        failed = [n for n in step.needs if self.record["steps"].get(n, {}).get("status") not in ("ok", "rehearsed")]
        remaining = self.budget_s - self.elapsed()
        if failed:
            record.update(status="skipped", reason=f"needs {', '.join(failed)}")
        elif remaining < max(step.min_s, MIN_STEP_S):
            record.update(status="skipped", reason=f"no time left ({remaining:.0f}s of the budget, "
                                                   f"it needs {max(step.min_s, MIN_STEP_S)}s)")
        else:
            self._execute(step, record, timeout=min(step.timeout_s, remaining - 5))
        self.say(f"{step.name}: {record['status']}" + (f" ({record['seconds']}s)" if "seconds" in record else "")
                 + (f" -- {record['reason']}" if "reason" in record else ""))
        self.save()

    def _execute(self, step: Step, record: dict, timeout: float) -> None:
        self.say(f"{step.name}: start (timeout {timeout:.0f}s)")
        record["status"] = "running"  # what a call killed at its limit leaves in the JSON
        self.save()
        result = Path(tempfile.mkstemp(prefix=f"{step.name}-", suffix=".json", dir=self.work)[1])
        command = [sys.executable, str(HERE / step.script), step.name, "--result", str(result)]
        command += ["--rehearse"] if self.rehearse else []
        log_offset = self.log.tell()
        self.log.write(f"----- {step.name}: {' '.join(command)}\n")
        begin = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, env=self.environment(step, timeout), stdout=self.log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the step and the ranks it launched
            process.wait()
            code = None
        record["seconds"] = round(time.monotonic() - begin, 1)
        text = result.read_text() if result.exists() else ""
        result.unlink(missing_ok=True)
        if code == 0 and text:
            record["result"] = json.loads(text)
            stopped = record["result"].get("stopped_at_gpu")
            record["status"] = "rehearsed" if self.rehearse else "ok"
            if stopped:
                record["reason"] = f"stopped where a GPU is needed: {stopped}"
        else:
            record["status"] = "timeout" if code is None else "failed"
            record["reason"] = f"killed after {timeout:.0f}s" if code is None else f"exit code {code}"
            self.log.flush()
            with open(self.log_path) as log:
                log.seek(log_offset)
                record["error_tail"] = log.read()[-4000:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", default="all", choices=["1", "2", "all"])
    parser.add_argument("--rehearse", action="store_true", help="CPU rehearsal: no GPU needed, numbers are not measurements")
    parser.add_argument("--out", type=Path, help="where the JSON and the log go (default: $OUT, else WORK/out)")
    parser.add_argument("--budget-s", type=float, default=570.0, help="seconds this call may take (the tool allows 600)")
    parser.add_argument("--only", help="comma-separated step names (the setup steps they need run too)")
    parser.add_argument("--build-here", action="store_true",
                        help="build both extensions on this machine even where the kit's prebuilt ones match")
    parser.add_argument("--use-env", action="store_true",
                        help="this Python already has megatron-core, the built extension (and TE for tier 2), "
                             "e.g. an NGC container: the setup steps check them instead of installing the kit")
    parser.add_argument("--commit", help="the commit this tree is (SHA, or SHA+dirty), recorded where the tree "
                                         "is no git checkout (the device tool's copy)")
    args = parser.parse_args(argv)
    tiers = [1, 2] if args.tier == "all" else [int(args.tier)]
    work = Path(os.environ.get("GPU_KIT_WORK", "/tmp/megatron-siamese-gpu"))
    work.mkdir(parents=True, exist_ok=True)
    if args.use_env:
        os.environ["GPU_KIT_USE_ENV"] = "1"  # read by setup_steps.py
    if args.build_here:
        os.environ["GPU_KIT_BUILD_HERE"] = "1"
    out = args.out or Path(os.environ.get("OUT") or work / "out")
    run = Run(out, args.budget_s, args.rehearse, tiers, work, commit=args.commit)
    run.record.update(use_env=args.use_env, build_here=args.build_here)
    steps = selected(tiers, args.only.split(",") if args.only else None)
    run.say(f"{'rehearsal' if args.rehearse else 'GPU run'}: tiers {tiers}, steps {', '.join(s.name for s in steps)}; "
            f"results in {run.json_path}")
    for step in steps:
        run.run_step(step)
    import report

    run.say("summary\n" + report.render([run.record]))
    statuses = [s["status"] for s in run.record["steps"].values()]
    return 0 if all(s in ("ok", "rehearsed") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
