-- The region tier of multiregion.locality; answered without pgmr.
SELECT multiregion.gateway_region();
