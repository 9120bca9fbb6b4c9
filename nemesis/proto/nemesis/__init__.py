"""Generated code for the ``nemesis`` protobuf package lives below (see ``nemesis.proto``)."""
