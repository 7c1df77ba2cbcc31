"""The daemon's webhooks: its events delivered to HTTP endpoints, at least once, signed as
Standard Webhooks sign them (:mod:`.service`, :mod:`.delivery`, :mod:`.tables`)."""
