"""The speed benchmark's report: the markdown tables of a `speed.json`
(`benchmarks.speed` measures it) — one optimizer update against AdamW and
against its floor, where its time goes, one training step, the optimizer
state's bytes, the retractions, the geoopt peer and the native layout —
each section rendered only if the results hold it.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict

import stiefel_optax as so
from benchmarks import harness


def _fmt_ms(x):
  return f"{x:.2f}" if x < 10 else f"{x:.1f}"


STACK_NOTE = ("stacked: `stiefel_attention(..., stack_frames=True)`, the"
              " frames of equal shape from all leaves updated as one batch;"
              " auto: `stack_frames=\"auto\"`, stacks of at most"
              f" {so.partition.AUTO_STACK_BYTES // 2**20} MiB (larger"
              " frames per leaf).")


def update_lines(res) -> list:
  out = ["## One optimizer update", ""] + harness.markdown_table(
      ["tree", "params", "Q/K frames", "adamw ms", "stiefel_attention ms",
       "ratio", "ratio of CPU time", "stacked ms", "ratio", "auto ms",
       "ratio"], "lrrrrrrrrrr",
      [[u["tree"], f"{u['params'] / 1e6:.2f} M", u["qk_frames"],
        _fmt_ms(u["adamw_ms"]), _fmt_ms(u["stiefel_ms"]), f"{u['ratio']:.2f}",
        f"{u['cpu_ratio']:.2f}", _fmt_ms(u["stacked_ms"]),
        f"{u['stacked_ratio']:.2f}", _fmt_ms(u["auto_ms"]),
        f"{u['auto_ratio']:.2f}"] for u in res["update"]])
  u = res["update"][0]
  out += ["", STACK_NOTE, ""] + floor_lines(u)
  prof = u["profile"]
  out += ["", f"## Where the update's time goes ({u['tree']})", ""]
  out += harness.markdown_table(
      ["part", "ms", "CPU ms"], "lrr",
      [[k, _fmt_ms(v), _fmt_ms(prof["parts_cpu_ms"][k])]
       for k, v in prof["parts_ms"].items()])
  out += ["", f"{prof['frames']} frames of ({prof['d']}, {prof['r']}); the"
          f" floor's products run at {prof['floor_gflops_per_s']:.1f} GFLOP/s."]
  return out


def floor_lines(u) -> list:
  """The update against its floor: per leaf, with its spread over the
  repeats and the gap itemized (runs recorded before the per-leaf floor:
  the one-stack floor as it was reported)."""
  if "floor_repeats" not in u:
    return [f"Against the floor ({u['tree']}: AdamW on the non-Q/K leaves"
            f" plus the five products, {_fmt_ms(u['floor_ms'])} ms):"
            f" stiefel_attention {u['floor_ratio']:.3f}x (CPU time"
            f" {u['floor_cpu_ratio']:.3f}x); stacked"
            f" {u['stacked_floor_ratio']:.3f}x, auto"
            f" {u['auto_floor_ratio']:.3f}x."]
  reps = u["floor_repeats"]
  ok = [r for r in reps if not r["disturbed"]]
  ratios = sorted(r["floor_ratio"] for r in ok)
  med = statistics.median
  out = [f"Against the floor ({u['tree']}): AdamW on the non-Q/K leaves"
         " plus the five d x r x r products per frame, timed per leaf (the"
         " layout the update runs), alternated with the update in the same"
         f" rounds. {len(reps)} measurements, {len(reps) - len(ok)}"
         " disturbed (AdamW on part of the tree slower than on all of it:"
         " reported, not used)" + (
             f"; stiefel_attention / floor {ratios[0]:.2f}x to"
             f" {ratios[-1]:.2f}x, median {med(ratios):.2f}x over"
             f" {len(ok)}; / adamw median"
             f" {med([r['adamw_ratio'] for r in ok]):.2f}x." if ok else
             "; no undisturbed measurement: no ratio is published.")]
  if ok:
    parts = list(ok[0]["gap_ms"])
    out += ["", "The update's time, itemized (medians over the undisturbed"
            " measurements, ms):", ""] + harness.markdown_table(
                ["part", "ms"], "lr",
                [[k, _fmt_ms(med([r["gap_ms"][k] for r in ok]))]
                 for k in parts]
                + [["stiefel_attention (their sum)",
                    _fmt_ms(med([sum(r["gap_ms"].values()) for r in ok]))]])
  prof = u["profile"]
  stacked, per_leaf = (prof["stacked_floor_gflops_per_s"],
                       prof["floor_gflops_per_s"])
  out += ["", "Why these figures differ from the older ones: those timed"
          " the floor's products on one concatenated stack of all"
          f" {prof['frames']} frames, not per leaf as the update runs them;"
          f" here the stack runs at {stacked:.0f} GFLOP/s and the leaves at"
          f" {per_leaf:.0f}, so the stacked floor was "
          + ("too high and its ratio flattered the update."
             if stacked < per_leaf else
             "no higher than the per-leaf one (in this run).")]
  return out


def train_step_lines(res) -> list:
  t = res["train_step"]
  return ["## One training step (forward, backward, update, apply)",
          ""] + harness.markdown_table(
              ["model", "params", "adamw ms", "stiefel_attention ms", "ratio",
               "ratio of CPU time", "stacked ms", "ratio", "auto ms", "ratio"],
              "lrrrrrrrrr",
              [[t["model"], f"{t['params'] / 1e6:.2f} M",
                _fmt_ms(t["adamw_ms"]), _fmt_ms(t["stiefel_ms"]),
                f"{t['ratio']:.3f}", f"{t['cpu_ratio']:.3f}",
                _fmt_ms(t["stacked_ms"]), f"{t['stacked_ratio']:.3f}",
                _fmt_ms(t["auto_ms"]), f"{t['auto_ratio']:.3f}"]])


def state_lines(res) -> list:
  mb = lambda b: f"{b / 2**20:.2f}"
  return ["## Optimizer state of the Q/K kernels", ""] + harness.markdown_table(
      ["tree", "Q/K params MB", "adamw MB", "stiefel_attention MB", "ratio"],
      "lrrrr",
      [[s["tree"], mb(s["qk_param_bytes"]), mb(s["adamw_bytes"]),
        mb(s["stiefel_bytes"]), f"{s['ratio']:.4f}"] for s in res["state"]])


def retraction_lines(res) -> list:
  rows = []
  for r in res["retraction"]:
    name = r["method"]
    if "ns_steps_delta_0.1" in r:
      name += (f" ({r['ns_steps_delta_0.1']} / {r['ns_steps_delta_1']} steps)")
    shape = f"({r['d']}, {r['r']}) x {r['heads']}"
    rows.append([name, shape, r["status"], "", ""] if "status" in r else
                [name, shape, _fmt_ms(r["ms"]), f"{r['iso_err_delta_0.1']:.1e}",
                 f"{r['iso_err_delta_1']:.1e}"])
  out = ["## Polar retraction of a batch of d / r heads, float32", ""]
  out += harness.markdown_table(
      ["method", "(d, r) x heads", "ms", "isometry error, delta 0.1",
       "isometry error, delta 1"], "llrrr", rows)
  out += ["", "Isometry error: max ||Q^T Q - I||_F of the float32 result,"
          " Q^T Q formed in float64. Newton–Schulz is timed sized for"
          " delta = 0.1 (the default cap); its delta = 1 error uses the steps"
          " sized for delta = 1."]
  return out


def layout_lines(res) -> list:
  r = res["layout"]
  out = ["## Native layout against the frame view, float32", ""]
  out += harness.markdown_table(
      ["layout", f"{r['leaves']} x {tuple(r['kernel'])} kernels, ms",
       "transposes and copies in the compiled program"], "lrr",
      [[x["layout"], _fmt_ms(x["ms"]), str(x["transposes"])]
       for x in r["rows"]])
  out += ["", "The step's five d x r x r products (W^T G, W^T m, W S,"
          " (W + xi)^T (W + xi), (W + xi) Z) per leaf, one jitted program"
          " for all leaves: as einsums over the kernel's own axes"
          " (`dhr,dhs->hrs`, `dhr,hrs->dhs`) with the momentum in kernel"
          " layout, and as the library computes them (W and G viewed as"
          " (heads, d, r) frames, the momentum kept in that view, the step"
          " transposed back). Native / view:"
          f" {r['native_over_view']:.2f}. Transposes: the `transpose` and"
          " `copy` instructions of XLA's optimized program on"
          f" {r['backend']}. Where the native program holds as many or more,"
          " XLA transposes the einsums' operands itself (its dot takes the"
          " batch axis, the heads, major), once per product instead of once"
          " per step: computing in the kernel's layout then moves the"
          " copies into XLA rather than removing them."]
  return out


def gram_lines(res) -> list:
  r = res["gram"]
  forms = list(r["rows"][0]["ms"])
  out = ["## The Gram product W^T G, float32", ""]
  out += harness.markdown_table(
      ["frames (n, d, r)", *(f"{f}, ms" for f in forms),
       "contraction / materialised"], "l" + "r" * (len(forms) + 1),
      [[str(tuple(x["shape"])), *(f"{x['ms'][f]:.4f}" for f in forms),
        f"{x['contraction_over_cpu_form']:.2f}"] for x in r["rows"]])
  calls = f", medians of {r['calls']} calls each" if "calls" in r else ""
  out += ["", f"One jitted batched W^T G of each form, alternated{calls}, on"
          f" {r['backend']}: one contraction over d, and A^T materialised"
          " (a copy kept by an optimization barrier) then a plain batched"
          " matmul. `stiefel_optax.geometry.gram` uses the second on CPU,"
          " the first elsewhere."]
  return out


PEER_TITLE = ("## Peer: geoopt's RiemannianAdam on EuclideanStiefel"
              " (PyTorch, CPU)")


def _adamw_cells(r) -> list:
  """optax.adamw's time on the peer's leaves and geoopt / adamw; dashes
  for runs recorded before that arm existed."""
  if "adamw_ms" not in r:
    return ["-", "-"]
  return [_fmt_ms(r["adamw_ms"]), f"{r['ratio_adamw']:.2f}"]


def peer_lines(res) -> list:
  p = res["peer"]
  out = [PEER_TITLE, ""]
  if p["status"] == "skipped":
    return out + [f"Skipped: {p['message']}."]
  default = lambda r: ([_fmt_ms(r["ours_default_ms"]),
                        f"{r['ratio_default']:.2f}"]
                       if "ours_default_ms" in r else ["-", "-"])
  out += harness.markdown_table(
      ["workload", "leaves x (heads, d, r)", "stiefel_adam ms", "geoopt ms",
       "geoopt / ours", "ratio of CPU time", "default path ms",
       "geoopt / default", "stacked ms", "geoopt / stacked",
       "auto ms", "geoopt / auto", "optax.adamw ms", "geoopt / adamw",
       "isometry error, ours", "isometry error, geoopt"], "llrrrrrrrrrrrrrr",
      [[r["workload"], f"{r['leaves']} x ({', '.join(map(str, r['shape']))})",
        _fmt_ms(r["ours_ms"]), _fmt_ms(r["geoopt_ms"]), f"{r['ratio']:.2f}",
        f"{r['cpu_ratio']:.2f}", *default(r), _fmt_ms(r["ours_stacked_ms"]),
        f"{r['ratio_stacked']:.2f}", _fmt_ms(r["ours_auto_ms"]),
        f"{r['ratio_auto']:.2f}", *_adamw_cells(r),
        f"{r['ours_iso_err']:.1e}",
        f"{r['geoopt_iso_err']:.1e}"] for r in p["rows"]])
  if p["status"] != "ok":
    out += ["", f"Failed after {len(p['rows'])} workload(s): {p['message']}"]
  if p["rows"]:
    r = p["rows"][0]
    out += ["", f"One step each, lr {p['lr']:g}, same float32 frames and"
            " gradients (NumPy, fixed seed): ours one jitted `stiefel_adam`"
            " update plus `optax.apply_updates` on the frame stacks;"
            " default path: `stiefel_attention(lr)` with every default"
            " (frames \"auto\", per leaf) on the same frames as Flax"
            " query/key kernels (d, heads, r), what a user's one line runs"
            " (stacked, auto: the"
            " leaves stacked by `frame_partition(..., stack_frames=True"
            " / \"auto\")`), geoopt one"
            " `optimizer.step()` with the gradients set. Medians over"
            f" {r['rounds']} rounds, each geoopt's k steps (in the child"
            " process) then ours k (k per workload: "
            + ", ".join(f"{x['k']}" for x in p["rows"]) + "). torch"
            f" {p['torch']} ({p['torch_threads']} threads), geoopt"
            f" {p['geoopt']}; jax on {p['threads']} cores. Isometry error:"
            f" max ||W^T W - I||_F (float64) after {r['iso_steps']} steps"
            f" from the same frames (start: {r['start_iso_err']:.1e}). Both"
            " keep one second moment per frame; ours caps the step at 0.1"
            " and retracts by polar (Newton–Schulz), geoopt by QR."
            " optax.adamw: the same jitted update plus apply on the same"
            " leaves, alternated with the others; it does no Riemannian"
            " work, so geoopt / adamw bounds what any optax transform"
            " reaches where per-operation dispatch, not arithmetic, sets"
            " the time (many small frames)."]
  with_cpu = [r for r in p["rows"] if "cpu_ratio_stacked" in r]
  if with_cpu:
    out += ["", "geoopt / ours in CPU time (the process's, all threads;"
            " steadier than wall time when other jobs share the cores): "
            + "; ".join(f"{r['workload'].split(':')[0]}: per leaf"
                        f" {r['cpu_ratio']:.2f}, stacked"
                        f" {r['cpu_ratio_stacked']:.2f}, auto"
                        f" {r['cpu_ratio_auto']:.2f}" for r in with_cpu)
            + "."]
  counted = [r for r in p["rows"] if "compiled_ops" in r]
  if counted:
    out += ["", "Operations per step in each compiled program (the entry"
            " computation's fusions, dots, conditionals and copies, one"
            " dispatched kernel each on CPU; where frames are small the"
            " time follows this count): " + "; ".join(
                f"{r['workload'].split(':')[0]}: ours {o['ours']},"
                f" default path {o.get('ours_default', '-')}, stacked"
                f" {o['ours_stacked']}, auto {o['ours_auto']}, optax.adamw"
                f" {o['adamw']}" for r in counted
                for o in [r["compiled_ops"]]) + "."]
  return out


def muon_lines(res) -> list:
  m = res["muon"]
  names = ("stiefel_muon", "optax muon", "adamw")
  rows = [[r["workload"], f"{r['leaves']} x ({', '.join(map(str, r['shape']))})",
           *[_fmt_ms(r["ms"][n]) for n in names], f"{r['over_muon']:.2f}",
           f"{r['over_adamw']:.2f}",
           " / ".join(str(r["compiled_ops"][n]) for n in names)]
          for r in m["rows"]]
  t = m["train_step"]
  rows.append([f"train step: {t['model']}", f"{t['params'] / 1e6:.2f} M"
               " params", *[_fmt_ms(t["ms"][n]) for n in names],
               f"{t['over_muon']:.2f}", f"{t['over_adamw']:.2f}", ""])
  return ["## What a Muon user pays for the constraint", ""] + (
      harness.markdown_table(
          ["workload", "leaves x (heads, d, r)", "stiefel_muon ms",
           "optax.contrib.muon ms", "optax.adamw ms",
           "stiefel_muon / muon", "stiefel_muon / adamw",
           "compiled ops (stiefel_muon / muon / adamw)"], "llrrrrrl", rows)
      + ["", f"One jitted update plus apply, lr {m['lr']:g}, alternated;"
         " stiefel_muon: the tangent msign step and the polar retraction"
         " (`so.stiefel_muon`), optax.contrib.muon: the same per-head"
         " matrices unconstrained (Nesterov 0.95, consistent RMS 0.2:"
         " `benchmarks.training.per_head_muon`). Train step: table 3's"
         " model, Muon on the per-head Q/K views (`stiefel_attention(...,"
         " stiefel_tx=so.stiefel_muon(lr))` against `frame_partition(muon,"
         " adamw)`), AdamW on the rest; adamw on everything."])


# (key of speed.json, the lines of its section), in the order printed.
MD_SECTIONS = (("update", update_lines), ("train_step", train_step_lines),
               ("state", state_lines), ("retraction", retraction_lines),
               ("peer", peer_lines), ("muon", muon_lines),
               ("layout", layout_lines), ("gram", gram_lines))


def markdown(res: Dict[str, Any]) -> str:
  """The tables of the sections that `res` holds."""
  title = ("stiefel_adam vs geoopt" if res.get("peer_only")
           else "stiefel_attention vs optax.adamw")
  out = [f"# Speed: {title}{' (quick)' if res['quick'] else ''}",
         "",
         f"Command: `{res['command']}`. {res['machine']}. Load average"
         f" (1/5/15 min) before {res['load_before']}, after"
         f" {res['load_after']}. Times: medians of jitted calls after"
         " warm-up, both sides alternated in the same run; ms are wall-clock,"
         " CPU ms the process's CPU time per call (all threads; steadier"
         " when other jobs share the cores)."]
  for key, section in MD_SECTIONS:
    if key in res:
      out += [""] + section(res)
  return "\n".join(out) + "\n"


def accelerator_markdown(res: Dict[str, Any]) -> str:
  """speed.md of `benchmarks/accelerator.sh`'s part (a): the machine, one
  row each for the update and the training step (per leaf, stacked, auto,
  each against adamw), then the native-layout and Gram-product tables."""
  rows = [[f"update: {res['update']['tree']}", res["update"]],
          [f"train step: {res['train_step']['model']}", res["train_step"]]]
  lines = harness.markdown_table(
      ["what", "adamw ms", "stiefel_attention ms", "ratio", "stacked ms",
       "ratio", "auto ms", "ratio"], "lrrrrrrr",
      [[name, f"{r['adamw_ms']:.3f}", f"{r['stiefel_ms']:.3f}",
        f"{r['ratio']:.3f}", f"{r['stacked_ms']:.3f}",
        f"{r['stacked_ratio']:.3f}", f"{r['auto_ms']:.3f}",
        f"{r['auto_ratio']:.3f}"] for name, r in rows])
  tables = [lines, layout_lines(res), gram_lines(res)]
  return (f"Machine: {harness.machine_line(res['machine'])}\n\n"
          + "\n\n".join("\n".join(t) for t in tables) + "\n")
