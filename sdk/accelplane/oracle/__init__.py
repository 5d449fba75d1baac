"""The float64 oracle: every op's reference result (:mod:`.reference`) and how a result is held
against it (:mod:`.compare`: NMSE, NaN and infinity rules)."""
