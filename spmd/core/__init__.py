"""Layer 1, data: meshes, partition specs, layouts and placeholders. Pure arithmetic.

Nothing here communicates or imports a backend: a ``Mesh`` names its backend, and
``spmd.comm.comm_of`` builds the communicator. Every other layer builds on these names.
"""
from .errors import CommAborted, CommError, CommTimeout, SpecError
from .layout import Layout
from .mesh import Group, Mesh
from .placeholder import Placeholder
from .spec import P

__all__ = ["Mesh", "Group", "P", "Layout", "Placeholder",
           "SpecError", "CommError", "CommTimeout", "CommAborted"]
