"""The parts the training recipe (april_jax/train.py) puts together: what a run trains on (task),
the model, reference and engine it builds (builders), held-out evaluation, the run's position
saved with each checkpoint (run_state) and its metrics sinks."""
