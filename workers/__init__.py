"""Pure torch + Ray workers: BN discovery, calibration math, sharding, data, actors."""
