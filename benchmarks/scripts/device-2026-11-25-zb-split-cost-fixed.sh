# one device call: the one-GPU split cost (tools/bench_zero_bubble.py --single-gpu) after the per-parameter
# weights-wanted check (an exception per parameter in a weight pass, about 20 us each) went back to one
# answer per node; new and old code (d788551, carried as .gl/oldtree) alternately, then the zero-bubble GPU tests
# .gl/oldtree: mkdir -p .gl/oldtree && git archive d788551 paddle_graphpp tools | tar x -C .gl/oldtree (run with carry [".gl/oldtree"])
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
for tag in fixed-1 old-4 fixed-2 old-5; do
  case $tag in old*) (cd .gl/oldtree && PYTHONPATH=$PWD timeout 200 python tools/bench_zero_bubble.py --single-gpu --name $tag > $R/$tag.txt 2>&1);;
               *) PYTHONPATH=$PWD timeout 200 python tools/bench_zero_bubble.py --single-gpu --name $tag > $R/$tag.txt 2>&1;; esac
  python -c "
import json,glob
d=json.load(open(glob.glob('$OUT/$tag-split-*.json')[0]))['results']
for s,e in d.items(): print('$tag', s, {k: (round(v['median_ms'],1), round(v['min_ms'],1), round(v['max_ms'],1)) for k,v in e['timings_ms'].items()})
"
done
PYTHONPATH=$PWD timeout 120 python -m pytest -q -p no:cacheprovider unittests/gpu/test_zero_bubble_gpu.py > $R/test_zero_bubble_gpu.txt 2>&1; echo "unittests/gpu/test_zero_bubble_gpu.py rc=$? $(tail -1 $R/test_zero_bubble_gpu.txt)" | tee $R/tests.txt
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
