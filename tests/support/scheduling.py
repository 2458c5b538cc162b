"""How pytest-xdist hands out the suite (`make test`: -n 2): whole modules to a worker, so that a
module's servers start once, and each group of modules sharing a session server to one worker."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling


class ModuleScheduling(LoadScopeScheduling):
    """xdist's loadscope with modules as scopes, `groups` (module -> group) joining some, and a
    worker's death handled as xdist's default scheduler handles it."""

    def __init__(self, config, log=None, groups: dict[str, str] | None = None):
        super().__init__(config, log)
        self.groups = groups or {}

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return self.groups.get(module, module)

    def _reschedule(self, node) -> None:
        """More work for `node`, unless it died since its last report: the work it could not be
        sent goes back to the front of the queue, and its death, reported next (remove_node), hands
        its module on. xdist would end the run with an INTERNALERROR (cannot send, already closed)."""
        assigned = self.assigned_work[node]
        before = len(assigned)
        try:
            super()._reschedule(node)
        except OSError:
            if len(assigned) > before:  # the unit assigned but not sent
                scope, unit = assigned.popitem()
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)

    def remove_node(self, node):
        """A worker that died (out of memory, say) fails the test it ran, and its module's other
        tests go to a worker. xdist's own loadscope would run the deadly test again and put back
        the modules the worker had finished: a finished module is sent as no tests, its worker
        then waits forever, and the run hangs."""
        workload = self.assigned_work.get(node, {})
        crashed = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None)
        if crashed is None:
            return super().remove_node(node)
        workload[self._split_scope(crashed)][crashed] = True
        for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
            del workload[scope]
        super().remove_node(node)
        return crashed
