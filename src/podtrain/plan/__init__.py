"""Plan before you pay, explain the gap after: ``podtrain plan`` and ``podtrain report``.

* ``memory``: memory per device, itemised, for ddp / fsdp / hsdp (pure arithmetic);
* ``steptime``: step time from FLOPs, the ring model of collectives, overlap, data, saves, eval;
* ``machine``: an instance preset or this host measured; ``shape``: a config's model counted;
* ``planner``: the ``plan`` command; ``report``: the ``report`` command; ``render``: their text.
"""
