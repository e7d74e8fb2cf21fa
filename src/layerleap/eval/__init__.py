"""Measuring the methods: the benchmark and its report (``bench``, ``report``, ``roofline``), the
exactness table (``exactness``), sweeps (``sweep``), exit-head match rates (``match_rate``), PPD's
theory and its multi-process runtime (``theory``, ``ppd_parallel``), and text-quality metrics
(``quality``)."""
