// Small line charts on a canvas: no chart library, nothing fetched.
'use strict';
function drawChart(canvas, series, opts) {
  // series: [{values: [...], color: '#hex', label: 'name'}]; all share the x axis (newest right).
  opts = opts || {};
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  const g = canvas.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const n = opts.points || 60;
  let max = opts.max || 0;
  for (const s of series) for (const v of s.values) if (v > max) max = v;
  if (max <= 0) max = 1;
  max *= 1.1;
  const top = 14, bottom = h - 4, left = 4, right = w - 4;
  g.strokeStyle = '#26313c'; g.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = bottom - (bottom - top) * f;
    g.beginPath(); g.moveTo(left, y); g.lineTo(right, y); g.stroke();
  }
  g.font = '11px system-ui, sans-serif'; g.fillStyle = '#8b98a5';
  g.fillText(formatNumber(max), left + 2, top - 3);
  let x = left + 60;
  for (const s of series) {
    const values = s.values.slice(-n);
    g.strokeStyle = s.color; g.lineWidth = 1.6; g.beginPath();
    values.forEach((v, i) => {
      const px = right - (values.length - 1 - i) * (right - left) / (n - 1);
      const py = bottom - (bottom - top) * (v / max);
      if (i === 0) g.moveTo(px, py); else g.lineTo(px, py);
    });
    g.stroke();
    if (s.label) {
      g.fillStyle = s.color;
      const last = values.length ? values[values.length - 1] : 0;
      const text = `${s.label} ${formatNumber(last)}`;
      g.fillText(text, x, top - 3); x += g.measureText(text).width + 14;
    }
  }
}
function formatNumber(v) {
  if (v >= 100) return v.toFixed(0);
  if (v >= 10) return v.toFixed(1);
  return v.toFixed(2);
}
