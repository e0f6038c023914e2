"""Planning: layouts inferred or searched (HiGHS), priced by the cost model."""
