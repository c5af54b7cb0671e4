"""Discrete-event simulation of GPU fleets on real traces, driving the real placement engine.

Modules: :mod:`~gpusched.sim.traces` (loaders), :mod:`~gpusched.sim.fleets` (fleet builders),
:mod:`~gpusched.sim.engine` (event loop), :mod:`~gpusched.sim.metrics`,
:mod:`~gpusched.sim.openb` (the FGD packing procedure) and :mod:`~gpusched.sim.jobs` (trace rows as
simulator jobs). The benchmark harnesses that drive it live in :mod:`gpusched.bench`. Import the
modules directly; this
package imports nothing so loading a trace never pulls in the placement engine.
"""

__all__: list[str] = []
