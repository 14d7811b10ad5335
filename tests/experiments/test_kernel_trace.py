"""experiments/kernel_trace.py on the CPU (the host plane's XLA thunks; on a GPU the same code
reads the CUDA streams of the device plane)."""
import jax
import jax.numpy as jnp
import pytest

from experiments import kernel_trace as kt


def test_kernel_times_reads_the_xla_ops():
  xs = [(jax.random.normal(jax.random.key(i), (256, 256)),) for i in range(2)]
  r = kt.kernel_times(lambda a: jnp.tanh(a @ a), xs, calls=6, warmup=1)
  assert r["calls"] == 6 and r["events"] > 0 and r["sum_us"] > 0 and r["span_us"] > 0
  assert all(name.startswith("tf_XLA") for name in r["lines"])          # no Python frames
  assert not any(k.startswith("$") for k in r["per_kernel_us"])
  assert abs(sum(r["per_kernel_us"].values()) - r["sum_us"]) < 1e-6
  assert "x: kernels" in kt.format_times("x", r)


def test_kernel_times_scales_with_the_work():
  """512x the flops must take longer (the trace's durations are real)."""
  small = [(jnp.ones((64, 64)),)]
  big = [(jnp.ones((512, 512)),)]
  f = lambda a: (a @ a @ a).sum()
  t_small = kt.kernel_times(f, small, calls=4)["sum_us"]
  t_big = kt.kernel_times(f, big, calls=4)["sum_us"]
  assert t_big > 4 * t_small


def test_kernel_times_rejects_bad_arguments():
  with pytest.raises(ValueError, match="calls"):
    kt.kernel_times(lambda a: a, [(jnp.ones(3),)], calls=0)
  with pytest.raises(ValueError, match="arg_sets"):
    kt.kernel_times(lambda a: a, [])
  with pytest.raises(RuntimeError, match="no events on planes"):
    kt.kernel_times(lambda a: a * 2, [(jnp.ones(3),)], calls=2, plane="/device:NONE")


def test_kernel_times_calls_per_run_divides_by_the_logical_calls():
  """Every per-call figure is divided by calls x calls_per_run: exactly, on synthetic events
  (``summarize_events``); and a traced program of 4 matmuls reports 4 x its traced runs as
  calls. (Timing ratios between programs are not checked: on the CPU XLA runs independent
  thunks concurrently, so their durations overlap.)"""
  ev = [("k", 0, 4000), ("m", 4000, 5000), ("k", 6000, 10000), ("m", 10000, 11000)]
  one = kt.summarize_events(ev, 1)
  two = kt.summarize_events(ev, 2)
  assert one == dict(per_kernel_us={"k": 8.0, "m": 2.0}, sum_us=10.0, span_us=11.0, events=4,
                     calls=1)
  assert two["per_kernel_us"] == {"k": 4.0, "m": 1.0} and two["sum_us"] == 5.0
  assert two["span_us"] == 5.5 and two["calls"] == 2
  x = [(jax.random.normal(jax.random.key(0), (256, 256)),)]
  four = kt.kernel_times(lambda a: [a @ (a + i) for i in range(4)], x, calls=3, calls_per_run=4)
  assert four["calls"] == 12 and four["sum_us"] > 0
  with pytest.raises(ValueError, match="calls_per_run"):
    kt.kernel_times(lambda a: a, x, calls=2, calls_per_run=0)
