"""A stand-in for ``dropless.train.loop.build`` while the trainer does not expose it.

``dropless profile`` reaches the trainer only through
``build(model_cfg, train_cfg, mesh_cfg) -> (state, step_fn, batches)``. Until
``dropless.train.loop`` has it, the end-to-end test installs this module in
its place: it assembles the same thing from the trainer's own parts (state
init, train step, optimizer, data source) on one device, without a mesh. Once
the real ``build`` exists the test uses it and this file is unused.
"""

import itertools
import sys
import types


def build(model_cfg, train_cfg, mesh_cfg):
    """(state, step_fn, batches) for one device from ``dropless.train`` parts."""
    import jax

    from dropless.train.data import make_source
    from dropless.train.optimizer import learning_rate_schedule, make_optimizer
    from dropless.train.remat import layer_remat
    from dropless.train.step import init_state_fn, make_train_step

    del mesh_cfg  # one device
    tx = make_optimizer(train_cfg.optimizer, train_cfg.steps)
    schedule = learning_rate_schedule(train_cfg.optimizer, train_cfg.steps)
    graphdef, init = init_state_fn(model_cfg, tx, train_cfg.seed, remat=layer_remat(model_cfg))
    state = jax.jit(init)()
    step_fn = jax.jit(make_train_step(graphdef, model_cfg, tx, schedule), donate_argnums=0)
    source = make_source(train_cfg.data, model_cfg.vocab_size,
                         batch=max(1, int(train_cfg.per_device_batch_size * jax.device_count())),
                         seq=train_cfg.max_target_length,
                         accum=train_cfg.gradient_accumulation_steps)
    batches = (jax.device_put(source.batch_at(i)) for i in itertools.count())
    return state, step_fn, batches


def install_if_needed() -> bool:
    """Make ``dropless.train.loop.build`` importable; True if the stand-in was installed."""
    import importlib

    try:
        loop = importlib.import_module("dropless.train.loop")
        if hasattr(loop, "build"):
            return False
    except ModuleNotFoundError:
        loop = None
    module = loop or types.ModuleType("dropless.train.loop")
    module.build = build
    sys.modules["dropless.train.loop"] = module
    import dropless.train

    dropless.train.loop = module
    return True
