"""The engine: host store, streaming schedule, chunked loss, pipelines and the host optimizer.

    config.py        EngineConfig: every knob, typed and checked once
    layout.py        what the engine allocates, as functions the planner (memory.py) uses too
    store.py         HostStore: flat per-unit buffers in host RAM (compute copy, master, grad)
    schedule.py      StreamingEngine: forward, loss, backward, one unit at a time
    inputs.py        each micro-batch checked and moved to the device, before the schedule runs it
    pipeline.py      the Pipeline seam, and HostPipeline (the CPU)
    cuda_pipeline.py CudaPipeline: ring slots, copy streams, events
    activations.py   layer inputs kept for the backward, offloaded to pinned memory if asked
    optimizer.py     HostAdamW: AdamW on the masters, unit by unit, on a host thread
    worker.py        host threads (ordered job worker, span pool) and Signal
    distributed.py   data parallel: each rank holds a slice of the fp32 state

Who owns what. Threads: the training thread (T), the optimizer's `megatrain-adamw` worker (A),
the pipeline's `megatrain-accumulate` worker (C); CUDA streams: compute (the current stream),
H2D and D2H. "Waits on" is what orders a reader after the writer.

  buffer              written by                        readers, and what orders them
  ------------------  --------------------------------  -----------------------------------------
  store.master[i]     unit i's AdamW step: A (T on the   the next step; checkpoints, named_master_params
  store.compute[i]    device stream for a resident       and the model's own parameters (views of the
                      unit); cleared `ready[i]` before   master) after synchronize(); the H2D load or
                      the step is queued, set after      the CPU compute of unit i, which waits on ready[i]
  store.grad[i]       1st contribution of a step: D2H    norms, named_grads, grad_norm and the step,
                      stream (T on the CPU or for a      after pipeline.finish() (every contribution
                      resident unit); later ones: C      landed); outside the step also after
                      (T on the CPU without background   ready[i] (no step still clipping it). The
                      jobs); scaled in place by the      next step's first contribution follows
                      clipped step (A)                   unit i's forward, which waited on ready[i]
  transient gradient  (transient_grads) taken in turn by   unit i's step (A) after its `landed()`; the
  buffer k            T for unit i's first contribution,  buffer is taken again only after ready[i]
                      after waiting on ready[j] of its    is set, i.e. unit i's step has run (or
                      previous unit j; then written as    failed: the taker raises); named_grads
                      grad[i] is (D2H / T / C)            refuses (no gradient outlives its step)
  grad[i] kept on     (gpu_grad_layers) the backward     unit i's host step (A): clipped in
  the GPU             of streamed layer i and its        place, then copied tile by tile on
                      later contributions (compute       its own stream after grad_event[i];
                      stream); `grad_event[i]` is        the next backward writes it only after
                      recorded after each                unit i's forward, which waited on ready[i]
  shared device       (transient_grads) the backward     resident layer i's step, queued by T on
  gradient buffer     of resident layer i (compute       the compute stream at its emit, before
                      stream)                            the next layer's backward writes it
  store.grad_count[i] T only, when a contribution is     T only: "first contribution" decisions
                      emitted (not when it lands)        never race a worker
  store.ready[i]      a Signal: cleared by T when a      every reader above; a failed step sets it
                      step is queued, set by A (or T)    with its failure, so waiters raise
  optimizer moments   the step of unit i (A / T)         the next step of unit i; checkpoints after
                                                         synchronize()
  ring slot           H2D stream, after waiting on the   compute, after waiting on the slot's
                      slot's `released` event (compute   `ready` event (recorded by the H2D copy)
                      done with its previous unit); a
                      lean unit's cast from its master
                      also waits on the `_masters` event
                      start() records (after the steps)
  grad ring slot      compute (the backward)             the D2H stream, after the `produced`
                                                         event; handed out again only after that
                                                         D2H (`released`)
  staging slab        D2H stream; taken free by T (or T  C adds it into grad[i] after the D2H
                      drains C for one)                  event completed, then marks it free
  pipeline norms[i]   T (resident units), D2H stream     grad_norm, after pipeline.finish()
                      (1st contribution), C (later)
  activation host     D2H stream (forward), after the    H2D stream (backward), after the D2H
  buffer of layer i   compute's `produced` event and     event `_stored[i]`; freed only after
                      the last H2D that read it          both copy streams drained

A failed host job sets its Signal with the failure: every waiter (a load on ready[i], an early
step on `landed()`, finish(), synchronize()) raises HostJobError instead of waiting for work
that will never come (worker.py).
"""
