"""Tools around the compiler: explain, calibrate, and the checked run on N ranks."""
