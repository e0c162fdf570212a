"""Deciding by simulation: ``simulate`` (the run a config would run, priced by ``pipeviz.cost``) over ``engine``
(ranks playing their actions) and ``collectives`` (gradient reductions); ``why`` (the critical path and the idle
gaps); ``trace_import`` (a profiler trace of a real run read onto the same timeline)."""
