"""The integration suite: the library on the real packages, in one command.

    python3 integration/run.py                 # every environment, every case
    python3 integration/run.py --env maxtext   # one environment
    python3 integration/run.py --case haliax   # cases whose name contains it
    python3 integration/run.py --list          # the cases, nothing run

For each environment of integration/pins.toml (one per set of packages that
conflict) it makes a virtual environment under integration/.venvs/<env>/
with the Python version the pins name and exactly the pinned packages
(again only when the pins change), and runs that environment's cases, with
this checkout first on PYTHONPATH (the working tree is the code under
test), from
integration/cases/ on the CPU, each in its own process with a time limit.
Each case prints what was selected, the frames' isometry after 5 steps and
that every other parameter equals AdamW's twin; the summary at the end
lists every case with PASS or FAIL and the failure's last line. The exit
status is 0 only when every case passed.

It needs Python >= 3.11 to run (tomllib) and, for each environment, that
Python version: found as ``python3.12`` on PATH, through ``pyenv``, or given
as STIEFEL_PYTHON_3_12=/path/to/python. Installs run under ``nice``; the
first run's install times and sizes: integration/README.md.

Not part of the main test suite (pytest collects tests/ and stiefel_optax/
only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

try:
  import tomllib
except ImportError:  # pragma: no cover
  sys.exit("integration/run.py needs Python >= 3.11 (tomllib): run it with"
           " python3.11 or newer.")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
VENVS = HERE / ".venvs"
CASES = HERE / "cases"
PINS = HERE / "pins.toml"
CASE_TIMEOUT = 1200      # seconds per case (a compile on 2 shared cores)
INSTALL_TIMEOUT = 3600   # seconds per pip install


def log(msg: str) -> None:
  print(f"[integration] {msg}", flush=True)


def _runs(exe) -> bool:
  """Whether `exe` is a working Python (a pyenv shim of a version that is
  not selected is not)."""
  try:
    return subprocess.run([str(exe), "-c", "import sys"], capture_output=True,
                          timeout=60).returncode == 0
  except OSError:
    return False


def find_python(version: str) -> str:
  key = "STIEFEL_PYTHON_" + version.replace(".", "_")
  if os.environ.get(key):
    return os.environ[key]
  candidates = [shutil.which(f"python{version}")]
  if shutil.which("pyenv"):
    out = subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                         timeout=60)
    if out.returncode == 0:
      root = pathlib.Path(out.stdout.strip()) / "versions"
      candidates += [d / "bin/python" for d in
                     sorted(root.glob(f"{version}.*"), reverse=True)]
  for exe in candidates:
    if exe and _runs(exe):
      return str(exe)
  raise SystemExit(
      f"integration/run.py: no Python {version} found (python{version} on"
      f" PATH, pyenv, or {key}=<path>); install it (pyenv install {version})"
      " or name it.")


def du(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*")
             if f.is_file() and not f.is_symlink())


def pip(venv: pathlib.Path, *args: str) -> None:
  cmd = ["nice", "-n", "10", str(venv / "bin/python"), "-m", "pip",
         "--disable-pip-version-check", *args]
  log(" ".join(cmd[3:6]) + " ...")
  subprocess.run(cmd, check=True, timeout=INSTALL_TIMEOUT)


def ensure_env(name: str, spec: dict, reinstall: bool) -> pathlib.Path:
  """The environment `name`, made from its pins unless it already is."""
  venv = VENVS / name
  python = find_python(spec["python"])
  pins = list(spec["packages"])
  stamp = hashlib.sha256(json.dumps([spec["python"], pins]).encode()
                         ).hexdigest()
  stamp_file = venv / ".pins-sha256"
  if (not reinstall and stamp_file.exists()
      and stamp_file.read_text() == stamp):
    log(f"{name}: environment up to date ({venv})")
  else:
    if venv.exists():
      shutil.rmtree(venv)
    VENVS.mkdir(exist_ok=True)
    log(f"{name}: making {venv} (Python {spec['python']}, {len(pins)}"
        " pinned packages)")
    t0 = time.time()
    subprocess.run([python, "-m", "venv", str(venv)], check=True,
                   timeout=600)
    reqs = venv / "requirements.txt"
    reqs.write_text("\n".join(pins) + "\n")
    no_deps = spec.get("no_deps", [])
    if no_deps:
      # Packages that declare no (or unusable) dependencies: their own
      # install does not resolve; everything they need is in `packages`.
      pip(venv, "install", "--no-deps", *no_deps)
    pip(venv, "install", "-r", str(reqs))
    seconds = time.time() - t0
    size = du(venv)
    record = {"env": name, "install_seconds": round(seconds),
              "size_mb": round(size / 2**20), "python": spec["python"],
              "packages": len(pins) + len(no_deps),
              "date": time.strftime("%Y-%m-%d")}
    (VENVS / f"{name}.install.json").write_text(json.dumps(record) + "\n")
    log(f"{name}: installed in {seconds:.0f} s, {size / 2**20:.0f} MiB")
    stamp_file.write_text(stamp)
  return venv


def run_case(venv: pathlib.Path, case: str) -> tuple[bool, str, float]:
  """Runs one case; (passed, last informative line, seconds)."""
  script, *args = case.split()
  env = dict(os.environ, JAX_PLATFORMS="cpu", STIEFEL_CASE=case,
             PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = str(ROOT)     # the checkout is the code under test
  t0 = time.time()
  try:
    proc = subprocess.run(
        ["nice", "-n", "10", str(venv / "bin/python"), script, *args],
        cwd=CASES, env=env, capture_output=True, text=True,
        timeout=CASE_TIMEOUT)
    stdout, out, code = (proc.stdout, proc.stdout + proc.stderr,
                         proc.returncode)
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (
        e.stdout or "")
    out = stdout + f"\nTimeout: over {CASE_TIMEOUT} s"
    code = -1
  seconds = time.time() - t0
  reported = [l for l in stdout.splitlines()
              if " | " in l or l.startswith("CASE ")]
  for line in reported:
    print("    " + line, flush=True)
  passed = code == 0 and any(l.startswith("CASE ") and l.endswith(" PASS")
                             for l in reported)
  if passed:
    return True, "", seconds
  lines = [l for l in out.splitlines() if l.strip()]
  errors = [l for l in lines if ("Error" in l or "Exception" in l
                                 or l.startswith("Timeout"))
            and not l.startswith(("  ", "I2", "W2", "E2"))]
  tail = (errors or lines or ["(no output)"])[-1]
  (VENVS / "logs").mkdir(parents=True, exist_ok=True)
  logfile = VENVS / "logs" / (case.replace(" ", "_").replace("/", "_")
                              + ".log")
  logfile.write_text(out)
  return False, f"{tail.strip()[:400]} (log: {logfile.relative_to(ROOT)})", \
      seconds


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--env", action="append", help="only these environments")
  ap.add_argument("--case", help="only cases whose name contains this")
  ap.add_argument("--reinstall", action="store_true",
                  help="remake the environments even if their pins match")
  ap.add_argument("--list", action="store_true", help="list the cases")
  args = ap.parse_args()
  pins = tomllib.loads(PINS.read_text())
  envs = {k: v for k, v in pins.items() if isinstance(v, dict)}
  if args.env:
    unknown = set(args.env) - envs.keys()
    if unknown:
      raise SystemExit(f"--env {sorted(unknown)}: not in {PINS.name}"
                       f" ({sorted(envs)})")
    envs = {k: envs[k] for k in args.env}
  results = []
  for name, spec in envs.items():
    cases = [c for c in spec["cases"]
             if not args.case or args.case in c]
    if not cases:
      continue
    if args.list:
      for c in cases:
        print(f"{name}: {c}")
      continue
    venv = ensure_env(name, spec, args.reinstall)
    known = spec.get("known_failures", {})
    for case in cases:
      log(f"{name}: {case}")
      ok, why, seconds = run_case(venv, case)
      results.append((name, case, ok, why, seconds, known.get(case)))
  if args.list:
    return 0
  print("\nSummary", flush=True)
  for name, case, ok, why, seconds, known in results:
    status = "PASS" if ok else "FAIL"
    print(f"  {status}  [{name}] {case}  ({seconds:.0f} s)")
    if not ok:
      print(f"        {why}")
      if known:
        print(f"        known: {known}")
  failed = sum(not r[2] for r in results)
  print(f"{len(results) - failed} passed, {failed} failed", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
