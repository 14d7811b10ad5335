"""Per-kernel device time from a JAX profiler trace (CUPTI on GPU), without Nsight Compute.

Whole-call device slopes of small programs (tens of microseconds) are noisy, and Nsight Compute
replays kernels (and can crash on Mosaic GPU ones). A profiler trace records every kernel's start
and end on the device at its own clocks, without replaying it. ``kernel_times`` runs a jitted
function ``calls`` times inside ``jax.profiler.trace``, reads the trace back
(``jax.profiler.ProfileData``), and returns:
- each kernel's mean device time per call;
- their sum per call (the device work of one call, launch gaps excluded);
- the span per call (first kernel start to last kernel end, over the back-to-back calls,
  divided by ``calls``; gaps included).

On the CPU the same code reads the host plane's XLA thunk events (``plane="/host:CPU"``); the
tests use that to check the parsing. On a GPU the default plane prefix "/device:GPU:" and the
stream lines ("Stream #...") hold the kernels.

  python -m experiments.kernel_trace   # a small matmul, the table printed
"""
from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax


# Lines of a device plane that repeat the kernels' time under other names (XLA's op and module
# timelines, steps): left out so that each kernel counts once.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework", "TensorFlow",
                  "Source", "Launch Stats")


# CPU host-plane events that wrap or mark the XLA ops rather than being one.
_CPU_CONTAINERS = ("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool", "end: ")


def _profile_options():
  """No HLO protos (a jitted function closing over a 128K-token cache embeds it as a constant,
  and the trace's XSpace can grow past protobuf's 2 GB limit: then there is no device plane) and
  no Python tracer; the host and device tracers as by default."""
  opts = jax.profiler.ProfileOptions()
  opts.enable_hlo_proto = False
  opts.python_tracer_level = 0
  return opts


def _lines(plane, line_prefix):
  """The plane's lines to read: those starting with ``line_prefix``, or (None) every line but
  the derived timelines."""
  lines = list(plane.lines)
  if line_prefix is None:
    return [ln for ln in lines if not ln.name.startswith(_DERIVED_LINES)]
  return [ln for ln in lines if ln.name.startswith(line_prefix)]


def kernel_times(fn, arg_sets, *, calls: int = 32, warmup: int = 2, plane: str | None = None,
                 line_prefix: str | None = None, name_filter=None, calls_per_run: int = 1):
  """Mean device time per call of each kernel a jitted function launches.

  Args:
    fn: a function of the arrays in each entry of ``arg_sets`` (jitted here if it is not).
    arg_sets: a list of argument tuples, used in turn (distinct inputs keep XLA from merging
      calls and the caches honest).
    calls: calls traced, back to back (outputs blocked on once, after the last).
    warmup: untraced calls first (compilation, autotuning).
    plane: prefix of the profiler planes to read: default "/device:GPU:" on a GPU backend and
      "/host:CPU" otherwise.
    line_prefix: only lines whose name starts with it. Default: on a GPU every line but the
      derived timelines ("XLA Ops", "XLA Modules", ...: the same kernels again), i.e. the
      CUDA streams; on the CPU "tf_XLA" (XLA's threads, not the Python frames).
    name_filter: None, or a predicate on event names to keep (default on the CPU: not the
      thunk executor's own events, which contain the ops').
    calls_per_run: logical calls made by one call of ``fn`` (e.g. a jitted program of that
      many calls, so that the span counts only the gaps between kernels of one executable,
      not the host's dispatch of each call): every per-call figure is divided by
      ``calls * calls_per_run``.

  Returns:
    dict(per_kernel_us={name: mean us per call}, sum_us (their sum), span_us (first start to
    last end / calls), events (count), calls, lines ({line name: events read})).

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((128, 128))
    >>> r = kernel_times(lambda a: (a @ a).sum(), [(x,)], calls=4, warmup=1)
    >>> r["calls"], r["sum_us"] >= 0.0
    (4, True)
  """
  if calls < 1 or calls_per_run < 1:
    raise ValueError(f"calls and calls_per_run must be >= 1, got {calls}, {calls_per_run}")
  if not arg_sets:
    raise ValueError("arg_sets must hold at least one argument tuple")
  gpu = jax.default_backend() == "gpu"
  plane = plane if plane is not None else ("/device:GPU:" if gpu else "/host:CPU")
  if line_prefix is None and not gpu:
    line_prefix = "tf_XLA"
    if name_filter is None:   # the executor's own events contain the ops' (counted twice)
      name_filter = lambda name: not name.startswith(_CPU_CONTAINERS)
  jfn = fn if hasattr(fn, "lower") else jax.jit(fn)
  for i in range(warmup):
    jax.block_until_ready(jfn(*arg_sets[i % len(arg_sets)]))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, profiler_options=_profile_options()):
      outs = [jfn(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
      jax.block_until_ready(outs)
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      raise RuntimeError(f"the profiler wrote no .xplane.pb under {d}")
    data = jax.profiler.ProfileData.from_file(paths[0])
  events, lines = [], collections.Counter()
  for pl in data.planes:
    if not pl.name.startswith(plane):
      continue
    for ln in _lines(pl, line_prefix):
      for ev in ln.events:
        if name_filter is not None and not name_filter(ev.name):
          continue
        events.append((ev.name, ev.start_ns, ev.end_ns))
        lines[ln.name] += 1
  if not events:
    planes = sorted({pl.name for pl in data.planes})
    raise RuntimeError(f"no events on planes starting with {plane!r} (planes in the trace: "
                       f"{planes}); on a GPU the device plane needs CUPTI (the profiler "
                       f"plugin's libcupti)")
  return dict(summarize_events(events, calls * calls_per_run), lines=dict(lines))


def summarize_events(events, calls):
  """Per-call figures of traced kernel events.

  Args:
    events: (name, start_ns, end_ns) of every kernel run in ``calls`` logical calls.
    calls: the logical calls the events cover.

  Returns:
    dict(per_kernel_us={name: total us / calls, largest first}, sum_us, span_us (first start
    to last end / calls), events, calls).

  Example:
    >>> summarize_events([("a", 0, 2000), ("b", 3000, 4000), ("a", 5000, 7000)], 2)["span_us"]
    3.5
  """
  total = collections.defaultdict(float)
  for name, start, end in events:
    total[name] += end - start
  per = {k: v / 1e3 / calls for k, v in sorted(total.items(), key=lambda kv: -kv[1])}
  first = min(e[1] for e in events)
  last = max(e[2] for e in events)
  return dict(per_kernel_us=per, sum_us=sum(per.values()), span_us=(last - first) / 1e3 / calls,
              events=len(events), calls=calls)


def format_times(name, r, top: int = 6):
  """One line: the row's kernel sum and span per call and its largest kernels.

  Args:
    name: the row's name.
    r: a ``kernel_times`` result.
    top: kernels listed.

  Returns:
    str.

  Example:
    >>> format_times("x", dict(per_kernel_us={"k": 1.5}, sum_us=1.5, span_us=2.0, events=4,
    ...                        calls=4))
    'x: kernels 1.50 us/call, span 2.00 us/call (4 events, 4 calls): k 1.50'
  """
  ks = ", ".join(f"{k[:48]} {v:.2f}" for k, v in list(r["per_kernel_us"].items())[:top])
  return (f"{name}: kernels {r['sum_us']:.2f} us/call, span {r['span_us']:.2f} us/call "
          f"({r['events']} events, {r['calls']} calls): {ks}")


if __name__ == "__main__":
  import jax.numpy as jnp
  xs = [(jax.random.normal(jax.random.key(i), (512, 512)),) for i in range(3)]
  print(format_times("matmul 512", kernel_times(lambda a: jnp.tanh(a @ a), xs, calls=8)))
