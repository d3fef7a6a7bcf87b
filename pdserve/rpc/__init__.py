"""gRPC contracts between nodes: generated stubs (``node_pb2*``, never hand-edited) plus the
conversions and channel/auth helpers every service shares."""
