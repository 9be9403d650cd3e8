"""How a step and each tensor travel: the route owner (``routing``, the only place a route is decided), the link's
prices it decides from (``plan``, ``netmodel``), the scatter route's owners (``owners``), the measured plan (``measure``) and LAGS-SGD's per-layer planning
(``layerwise``). It knows no runtime."""
