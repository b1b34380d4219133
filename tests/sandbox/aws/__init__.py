"""AWS test sandbox: moto over real HTTP plus an instance runner that executes user-data.

See README.md in this directory for ports, the connection, the instance environment, moto's
behaviour and gaps. Typical use::

    from tests.sandbox.aws import AwsSandbox
    sandbox = AwsSandbox()
    conns = sandbox.up()          # idempotent; writes <state>/connections.json
    ...
    sandbox.down()
"""

from .sandbox import AwsSandbox, SandboxError

__all__ = ["AwsSandbox", "SandboxError"]
