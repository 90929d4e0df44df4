"""``model.init_from``: a fresh start of a run takes its weights from a Hugging Face model folder.

Called by the loop after the restore found nothing to resume (``Trainer._setup_checkpoints``), so
a run that has a checkpoint of its own always resumes from it and never reads the folder's
weights again. The model was built from the folder's config.json (``model.init_config``) and
wrapped by its strategy; ``podtrain.ckpt.hf_source`` fills it, each rank reading its share. The
run's lineage records the folder and its content hash as its parent (``RUN_DIR/lineage.json``
and every manifest), so a branch can be traced to the weights it started from.
"""

from __future__ import annotations

import logging

from podtrain.ckpt import lineage
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.hf_source import InitStats, load_folder
from podtrain.distributed.group import DistContext
from podtrain.model import unwrap
from podtrain.train.replicas import check_replicas
from podtrain.train.state import Learner

log = logging.getLogger("podtrain")


def initialise_from_folder(url: str, learner: Learner, checkpointer: Checkpointer, ctx: DistContext) -> InitStats:
    """Every rank: load folder ``url`` into the learner's model (the optimizer stays fresh), record
    it in the run's lineage, verify the replicas agree. Returns this rank's load figures."""
    stats = load_folder(url, unwrap(learner.model), learner.optimizer, ctx)
    identity = checkpointer.identity
    identity.parent = stats.folder.record()
    if ctx.is_main:
        lineage.write(checkpointer.run_dir, identity)
    total = ctx.all_reduce_max([float(stats.bytes_read), stats.seconds])
    log.info("weights from %s (sha256 %s): %d tensors, %.1f MB in the folder; the most any rank read: "
             "%.1f MB, in %.2f s", url, stats.folder.sha256[:12], len(stats.folder.tensors),
             stats.folder.nbytes / 1e6, total[0] / 1e6, total[1])
    check_replicas(learner.model, ctx, before_ddp=False)
    return stats
