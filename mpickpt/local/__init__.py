"""The node-local level: checkpoints committed in each node's own directory first, protected
from the loss of a node by partner copies or XOR parity, drained to ROOT now and then."""
