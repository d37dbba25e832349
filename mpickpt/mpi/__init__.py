"""The protocol layer: every collective with a deadline on a private communicator, the roll call
when one is missed, the exit vote. With :mod:`mpickpt.run`, the only code that talks MPI."""
