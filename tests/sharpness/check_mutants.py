"""Run each mutant of tests/sharpness/mutants.py: copy the repository, break it as the mutant says, run the
test that must catch it, and report whether it did.

    make test-sharpness                      # the unit and stack mutants (~15 min on 2 cores)
    python tests/sharpness/check_mutants.py --cost unit --baseline
    python tests/sharpness/check_mutants.py --only log-mode-corrects

A mutant is caught when its test fails on the broken copy (pytest exit code 1). A copy that does not even
collect (exit code 2 to 4) proves nothing and counts as an error, as does, with --baseline, a test that fails
on the unbroken copy too. Exit status: 0 when every mutant that ran was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mutants import MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]
#: Built, git-ignored parts a copy uses as they are (linked, not copied): the generated protobuf code is
#: copied instead, since a mutant never edits it but the copy's imports must find it beside its sources.
LINKED = ("infra/kafka/target", "load-tests/.venv-litellm", ".cache", ".venv", "infra/k8s/bin")
GENERATED = "services/mars/v1"


def copy_repo(into: Path) -> Path:
    """The working tree's files (tracked, and new ones not ignored) copied under `into`, the built parts
    linked."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, into / name, follow_symlinks=False)
    shutil.copytree(REPO / GENERATED, into / GENERATED, dirs_exist_ok=True)
    for name in LINKED:
        if (REPO / name).exists():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).symlink_to(REPO / name)
    return into


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(
            f"{mutant.name}: the text to break occurs {text.count(mutant.old)} times in {mutant.path}"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def run_test(root: Path, test: str, log: Path) -> int:
    """pytest's exit code for `test` in the copy at `root` (its code first on the path), output to `log`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "services"), str(root / "infra")])}
    env.pop("PYTEST_ADDOPTS", None)
    # A temp root of the run's own: pytest keeps only the last three numbered dirs under /tmp/pytest-of-<user>,
    # so another pytest running meanwhile would delete this one's Postgres data directory under it. A short
    # path: a unix socket a test makes below it (containerd's, in the kubelet tests) has at most 107 bytes.
    basetemp = Path(tempfile.mkdtemp(prefix="mars-mt-"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--durations=0",
           f"--basetemp={basetemp}", test]
    try:
        with log.open("w") as fh:
            return subprocess.run(
                cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False
            ).returncode
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)


def check(mutant: Mutant, workdir: Path, baseline: bool) -> tuple[str, float]:
    """("caught" | "MISSED" | "error: ...", seconds) for one mutant."""
    began = time.monotonic()
    if baseline:
        clean = copy_repo(workdir / f"{mutant.name}-clean")
        code = run_test(clean, mutant.test, workdir / f"{mutant.name}-clean.log")
        shutil.rmtree(clean, ignore_errors=True)
        if code != 0:
            return f"error: the test fails on the unbroken copy too (exit {code})", time.monotonic() - began
        if " passed" not in (workdir / f"{mutant.name}-clean.log").read_text():
            # A skipped test (a control plane not built, say) passes too and would prove nothing.
            return "error: the test did not run on the unbroken copy (skipped)", time.monotonic() - began
    broken = copy_repo(workdir / mutant.name)
    apply(mutant, broken)
    code = run_test(broken, mutant.test, workdir / f"{mutant.name}.log")
    shutil.rmtree(broken, ignore_errors=True)
    if code == 1:
        verdict = "caught"
    elif code == 0:
        verdict = "MISSED"
    else:
        verdict = f"error: pytest exit {code} (not a failing test: see the log)"
    return verdict, time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cost", default="unit,stack", help="which mutants by cost: unit, stack, k8s (default %(default)s)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="mutants by name (default: all of --cost)")
    parser.add_argument("--baseline", action="store_true", help="also run each test on the unbroken copy")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the copies' logs here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    costs = set(args.cost.split(","))
    chosen = [m for m in MUTANTS if (m.name in args.only if args.only else m.cost in costs)]
    if args.list or not chosen:
        for m in MUTANTS:
            print(f"{m.name:32} {m.cost:6} {m.breaks}")
        return 0 if args.list else 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mars-sharpness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"{len(chosen)} mutants; logs in {workdir}", flush=True)
    results = []
    for i, mutant in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {mutant.name}: {mutant.test}", flush=True)
        verdict, spent = check(mutant, workdir, args.baseline)
        results.append((mutant, verdict, spent))
        print(f"    {verdict} in {spent:.0f} s", flush=True)
    print(f"\n{'mutant':32} {'verdict':10} {'s':>5}  what the test claims")
    for mutant, verdict, spent in results:
        print(f"{mutant.name:32} {verdict.split(':')[0]:10} {spent:5.0f}  {mutant.breaks}")
    return 0 if all(v == "caught" for _, v, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
