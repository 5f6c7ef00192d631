// The sidebar's linter: typescript-eslint's recommended rules over the sources and their unit tests.
import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['lib/', 'lib-test/', 'node_modules/', '../jupyter_gpulease/labextension/'] },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  {
    rules: {
      eqeqeq: 'error',
      curly: 'error',
      '@typescript-eslint/no-unused-vars': ['error', { args: 'none' }]
    }
  }
);
