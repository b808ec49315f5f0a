"""dsa_bridge.transfer — the wire side."""
