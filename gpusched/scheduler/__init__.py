"""The scheduling cycle every driver runs: both executors and the simulator decide through it.

One cycle takes every input explicitly — the pending work, the fleet snapshot, the running
tasks, the policy, the quota state and the clock, in one :class:`~gpusched.scheduler.cycle.CycleRequest`
— and returns what to start and what to hold (:func:`~gpusched.scheduler.cycle.decide`).
Around it: multi-node gangs (:mod:`.gangs`), the quota state a cycle places with (:mod:`.quota`),
run times learnt from finished work (:mod:`.durations`), the service earlier tries attained
(:mod:`.attained`), task keys (:mod:`.keys`). The Airflow executors (``gpusched.airflow``)
translate Airflow's task instances into pending work and carry out the reply; the simulator
(``gpusched.sim``) feeds a trace through the same cycle.
"""
