"""Recipe -> megatron-core model: the config mapping, layer specs, machine capabilities."""
