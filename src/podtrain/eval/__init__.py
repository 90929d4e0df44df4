"""Evaluation as the field does it: lm-evaluation-harness over podtrain's own model, in the loop
(``eval.tasks``) and after (``podtrain eval``), with offline tasks made from podtrain's own data.

adapter.py (lm-eval's ``LM``), scoring.py (the batched model work), lockstep.py (a sharded
model's forwards in step over the ranks), progress.py (progress lines), tasks.py (shipped tasks),
harness.py (lm-eval's task index and evaluator), evaluator.py (one evaluation on every rank),
source.py (what ``podtrain eval`` loads), cli.py (``podtrain eval``). Nothing here imports the
training loop; the loop reaches ``evaluator.py`` only when ``eval.tasks`` is set.
"""
