"""The warm start: supervised fine-tuning on scripted-teacher trajectories before RL.

``trajectories.py`` runs the teacher through the real harness loop; ``sft.py`` trains on
the resulting trees; ``cache.py`` builds a checkpoint once per (suite, harness, model,
tokenizer) and points a run config at it; ``cli.py`` is ``gyre-hpc warmstart``.
"""
