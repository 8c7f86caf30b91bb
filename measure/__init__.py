"""meshplan.measure: run kernels and collectives on this machine and record what they took.

- `calibrate`: collective curves per link tier, GEMM efficiency and codec speed on real
  ranks (`meshplan calibrate`), written as a `ClusterProfile` the cost model prices with;
- `profile`: every op the IR emits replayed on real tensors and timed (`meshplan profile`),
  appended to the op-latency dataset the learned latency model trains on
  (`meshplan.cost_model.dataset`);
- `codec_speed`: the lossless codec's throughput and per-call cost on this device;
- `sensitivity`: how much the user's loss rises with each linear of the layers lowered to
  int8 / fp8 (`linear_sensitivity`), which per-group precision lowers first.

This floor stands on the runtime (to start ranks, to run the codec) and on the cost model (the
types it fills); the cost model only prices, from numbers measured here or written down, and
never starts a process.
"""
