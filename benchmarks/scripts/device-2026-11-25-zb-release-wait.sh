# one device call: handed gradients given back to the pool only once every position in flight when
# they were made has its whole backward captured (the producer's weight half may read them too).
# The GPU test files that touch it (one GPU; two-GPU cases skip), then the zero-bubble and 1F1B last
# pp=2 GPT-3 1.3B stage with graph_loss, outputs kept as PipelineStage keeps them (memory; side by side)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
for f in unittests/gpu/test_zero_bubble_gpu.py unittests/gpu/test_engine_gpu.py unittests/gpu/test_hf_gpu.py; do
  timeout 200 python -m pytest -q -p no:cacheprovider $f > $R/$(basename $f .py).txt 2>&1; echo "$f rc=$? $(tail -1 $R/$(basename $f .py).txt)" | tee -a $R/tests.txt
done
grep -h "FAILED\|Error\|error" $R/test_*.txt | head -20
S="python tools/stage_memory.py --stages 1 --steps 8 --steady-from 3 --timeout 150 --keep-outputs"
for q in 512 2048; do
  timeout 300 $S --order zb --variants eager,graphed_loss --seq-len $q --out $R/zb-keep-s1-seq$q.json > $R/zb-keep-s1-seq$q.txt 2>&1 &
done
timeout 300 $S --variants eager,graphed_loss --seq-len 2048 --out $R/1f1b-keep-s1-seq2048.json > $R/1f1b-keep-s1-seq2048.txt 2>&1 &
wait
for f in zb-keep-s1-seq512 zb-keep-s1-seq2048 1f1b-keep-s1-seq2048; do echo "== $f"; grep -h "^stage\|ERROR\|Error" $R/$f.txt | cut -c1-200; done
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
