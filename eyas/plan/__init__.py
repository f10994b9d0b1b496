"""`eyas plan`: what a run will cost before it starts (samples, tokens, disk, GPU memory, time), from
configs and measured rates only: no weights are loaded."""
