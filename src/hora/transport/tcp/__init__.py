"""TCP transport: authenticated, framed TCP connections between ranks (see transport/base.py).

``TcpTransport`` owns one listener and the Pairs of one rank; ``TcpPair`` is one connection.
Layout: ``wire`` (frame header, exact I/O, socket options), ``auth`` (HMAC handshake, also used
by the rendezvous store), ``pair`` (framing and background I/O), ``transport`` (listening,
connecting, addresses).
"""

from hora.transport.tcp.pair import TcpPair
from hora.transport.tcp.transport import AddressBook, TcpTransport

__all__ = ["AddressBook", "TcpPair", "TcpTransport"]
