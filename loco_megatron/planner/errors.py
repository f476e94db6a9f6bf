"""The planner's one error type."""


class PlannerError(ValueError):
    """Invalid planner input. The message names the flag (``--inter-node-gbps``, ...) and says
    what to do; the CLI prints it as ``error: ...`` and exits with status 2."""
