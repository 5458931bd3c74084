"""The restart control plane: the store protocol of a restart (events, seats,
barriers, decisions), the membership table, the torch-free TCPStore client,
a rank's link to its node agent, and the launcher's incarnation that scopes every
key. Imports no torch: the helper processes use it.
"""

from .. import _native
from ..exception import BarrierOverflow, TimeoutError
from .store_errors import StoreConnectionError, StoreProtocolError, StoreTimeoutError

# What the native store connection and relay raise, by their C++ error: the package's own classes.
_native.set_error_classes(timeout=StoreTimeoutError, closed=StoreConnectionError, protocol=StoreProtocolError,
                          overflow=BarrierOverflow, cancelled=TimeoutError)
