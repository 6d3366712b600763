"""The processes of a run: collectives, their order, DTensors, loopback."""
