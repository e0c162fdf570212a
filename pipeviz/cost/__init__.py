"""The one cost model: what a layer and a stage cost in time, what a rank holds in memory, and on what machine.

Modules, bottom up (each imports only the ones above it in this list, and none imports the plan or graph modules
at run time):

- ``calibration``: constants measured on a machine, with their measurement (``calibration.json``);
- ``machine``: ``Hardware`` (the presets, each figure with its datasheet; ``"cpu"``: this machine measured) and
  the nominal devices (``LINKS``, ``FLOPS_PER_S``);
- ``measured``: ``Profile``, a measurement of each layer's time (``pv.profile``, ``cost.profiler``);
- ``roofline``, ``replay``: an op's time on a ``Hardware`` (its roofline) or on this CPU (replayed);
- ``comm``: links and collectives (all-reduce, DDP buckets, tensor and context parallelism's exchanges) and a
  process's share of a stage under a mesh (``parallel_costs``);
- ``options``: ``CostOptions``, the settings every cost takes;
- ``model``: ``Costs`` per stage and microbatch, from one time source chosen once (``time_source``: a profile,
  else the replay or the roofline on a ``Hardware``, else FLOPs at a nominal device's rate);
- ``memory``: the one memory rule (a stage's bytes, a rank's peak over a schedule's order) that ``pv.simulate``,
  ``pv.balance`` and the planner all call, and a plan's priced memory and table.

``pipeviz.costs`` and ``pipeviz.hardware`` keep the names they held before 0.3.
"""
